"""Per-device memory of a run, estimated before it starts (`postrl check-config`).

Pure functions of the model's shape (its config.json, or the published Qwen2.5 shapes below for a
hub id that is not on disk) and of the run's settings. An estimate, not a measurement: it counts the
tensors postrl keeps and the ones autograd saves, and leaves out the allocator's fragmentation, CUDA
context (~0.5 GiB) and NCCL buffers. docs/gpu.md compares it with measured peaks.

Notation: P parameters, W devices, s = 1/W under FSDP2 (sharded) and 1 otherwise (DDP replicates),
b bytes of the compute dtype (2 for bf16, 4 for fp32); per decoder layer: h hidden size, k = kv
heads x head dim, i MLP width; L layers, V vocabulary.

Resident state (runtime.py: fp32 master weights whatever model.dtype says):
  parameters 4 P s   gradients 4 P s   optimizer 8 P s (AdamW's exp_avg and exp_avg_sq, fp32)
  compute weights    bf16 copies the forward uses: 2 P on one device or DDP (autocast keeps a cast
                     of every weight through forward and backward); under FSDP2 two gathered blocks
                     (the one computing and the prefetched one): 2 x 2 x (block params); 0 in fp32
  reference          b P s for the KL reference (frozen, compute dtype); 0 without KL or offloaded
                     (held with algorithm.kl.coef > 0 or algorithm.use_kl_in_reward: assembly.held_models)
  critic             PPO's value model (algorithm.adv_estimator: gae): the backbone and a one-label head,
                     P_c = P - V h (untied LM head dropped) + h + 1, trained in full: 4 P_c s weights,
                     4 P_c s gradients (freed before rollout), 8 P_c s AdamW
  other models       the rest of what assembly.held_models lists, resident in both phases, unsharded (every
                     rank loads its own): the reward model, a sequence classifier (P_r = P - V h (untied LM
                     head dropped) + h, no bias) in reward_model.dtype (default model.dtype), when it is on the
                     run's device (reward_model.device: auto, not offloaded); the judge, a causal LM in fp32
                     (as it loads) on the run's device (a vLLM judge's own cache share is not counted); async's
                     rollout worker, a copy of the policy beside the trainer on its device (4 P, LoRA b P + 4 A)
Activations of one micro-batch of N tokens (the update pass; the log-prob passes keep none):
  per token and layer, what autograd saves for a Qwen2/Llama block with flash / SDPA attention (no
  [T x T] scores): normed inputs of attention and MLP (2h), q, k, v (h + 2k), q and k after RoPE
  (h + k), attention output (h), gate, up, silu(gate), and their product (4i), in the compute
  dtype, plus the two RMSNorms' fp32 inputs (2 x 4h bytes):
      A = b (5h + 3k + 4i) + 8h   bytes per token per layer
  (with a q width other than h, as Qwen3's heads x head_dim: b (2h + 3q + 3k + 4i) + 8h)
  without checkpointing: N L A; with model.gradient_checkpointing (each layer's input kept, one
  layer recomputed at a time): N L r h + N A, r = 4 (fp32 residual stream under autocast) or b.
Log-prob logits of one micro-batch's N_r response tokens (models.response_logprobs): the logits
  in the compute dtype, kept for backward, and their gradient beside them in backward (2 N_r V b);
  the fp32 log-softmax runs over chunks of C = min(train.logprob_chunk_tokens, N_r) tokens, three
  fp32 [C x V] tensors at a time (scaled logits, softmax, gradient; algorithms.token_logprobs):
      2 N_r V b + 12 C V  bytes.
  N = micro_batch_size x (max_prompt_length + max_tokens), or max_token_len_per_device with dynamic
  batch size (x u with sequence parallelism, verl's convention); N_r = the response share of N, N x max_tokens / (max_prompt_length + max_tokens).
LoRA (model.lora_rank r > 0, adapters on a of the 7 projections, A = L r sum over them of in + out):
  parameters b P s + 4 A s (the frozen base in the compute dtype, fp32 adapters)   gradients 4 A s
  optimizer 8 A s   compute weights: 2 A on one device or DDP (the base computes as it is), the
  gathered blocks under FSDP2   reference 0 (the base with adapters off, unless
  checkpoint.ref_model_path names another model); activations as above.
Mixture of experts (Qwen3-MoE, Qwen3-VL-MoE: E experts of width i_e, the router picks K per token):
  each layer's MLP is a router (h x E) and E gated experts (3 h i_e each), so P counts every expert
  and the active parameters P_a count K of them (what one token computes). FSDP2 shards the experts
  like every other weight (4 P s of masters, gradients 4 P s, AdamW 8 P s); a gathered block holds
  all E experts. Per token and layer the MoE MLP saves the router's logits (b E, softmax in fp32:
  4 E) and, for each of its K experts, the routed input, gate, up, silu(gate), their product and
  the weighted output: M = b (K (2h + 4 i_e) + E) + 4 E bytes in place of b 4i. Qwen3's per-head
  q / k RMSNorms add their fp32 inputs, 4 (q + k) bytes.
Ulysses sequence parallelism (train.sequence_parallel_size u): a micro-batch's N tokens are split
  across u ranks (all-to-all over heads around attention), so activations and log-prob logits count
  N / u tokens per rank; the weights stay sharded over all W devices by FSDP2.
Rollout, on top of the resident state less the gradients (freed before each rollout):
  vLLM: its share of the device, gpu_memory_utilization x device memory (weights, KV cache, graphs;
  asleep during the update). HF generate: the compute weights and a KV cache of 2 L k b bytes per
  token for this rank's gen_batch_size x n / W sequences of max_prompt_length + max_tokens tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a decoder-only transformer (a Qwen2 / Llama config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool  # tie_word_embeddings: the LM head is the embedding matrix
    qkv_bias: bool = True  # Qwen2: biases on q, k, v
    head_dim: int | None = None  # default hidden / heads
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    experts: int = 0  # MoE: experts per layer (0: a dense MLP of width `intermediate`)
    experts_per_token: int = 0  # MoE: the router's top-k
    expert_intermediate: int = 0  # MoE: one expert's MLP width (moe_intermediate_size)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    def block_params(self, active: bool = False) -> int:
        """One decoder layer: q, k, v, o projections, gated MLP (MoE: router and experts, `active`:
        only the top-k a token uses), two RMSNorm weights (and Qwen3's q / k norms)."""
        h, q, k, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = h * q + 2 * h * k + q * h + ((q + 2 * k) if self.qkv_bias else 0)
        attn += 2 * (self.head_dim or h // self.heads) if self.qk_norm else 0
        if self.moe:
            mlp = h * self.experts + (self.experts_per_token if active else self.experts) * 3 * h * self.expert_intermediate
        else:
            mlp = 3 * h * i
        return attn + mlp + 2 * h

    def params(self, active: bool = False) -> int:
        """Every parameter; `active`: those one token computes (MoE: K of the E experts per layer)."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.block_params(active) + self.hidden

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of a decoder layer's linear layers, by module name (LoRA's targets)."""
        h, q, k, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = {"q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h)}
        if self.moe:  # transformers 5 holds the experts as 3-D parameters, not linear layers: attention only
            return attn
        return {**attn, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def adapter_params(self, rank: int, target_modules: str | list[str] = "all-linear") -> int:
        """LoRA parameters of `rank` on `target_modules` ('all-linear': the 7 projections of every layer)."""
        dims = self.projections()
        names = dims if target_modules == "all-linear" else [n for n in target_modules if n in dims]
        return self.layers * rank * sum(sum(dims[n]) for n in names)


# Published Qwen2.5 configs (huggingface.co/Qwen/Qwen2.5-<size>/blob/main/config.json). The small
# models share the 151,936-token vocabulary with tied embeddings; from 7B on the table is padded to
# 152,064 and the LM head is a matrix of its own.
QWEN25 = {
    "0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936, tied=True),
    "1.5b": Shape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151_936, tied=True),
    "3b": Shape(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151_936, tied=True),
    "7b": Shape(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152_064, tied=False),
    "14b": Shape(hidden=5120, layers=48, heads=40, kv_heads=8, intermediate=13824, vocab=152_064, tied=False),
    "32b": Shape(hidden=5120, layers=64, heads=40, kv_heads=8, intermediate=27648, vocab=152_064, tied=False),
    "72b": Shape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=29568, vocab=152_064, tied=False),
}


# Published Qwen3 MoE configs (huggingface.co/Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B; the Qwen3-VL MoE models'
# text_config is the same decoder): 128 experts, 8 per token, q / k norms, no biases, untied head.
QWEN3_MOE = {
    "30b-a3b": Shape(hidden=2048, layers=48, heads=32, kv_heads=4, intermediate=6144, vocab=151_936, tied=False,
                     qkv_bias=False, head_dim=128, qk_norm=True, experts=128, experts_per_token=8, expert_intermediate=768),
    "235b-a22b": Shape(hidden=4096, layers=94, heads=64, kv_heads=4, intermediate=12288, vocab=151_936, tied=False,
                       qkv_bias=False, head_dim=128, qk_norm=True, experts=128, experts_per_token=8, expert_intermediate=1536),
}  # fmt: skip


def shape_from_config(cfg: dict) -> Shape | None:
    """The Shape of a config.json (a VLM's text model for Qwen2.5-VL / Qwen3-VL); None for what it cannot
    describe (MoE with shared experts or dense layers between sparse ones)."""
    text = cfg.get("text_config") or cfg
    if "hidden_size" not in text or text.get("shared_expert_intermediate_size"):
        return None
    experts = text.get("num_experts") or text.get("num_local_experts") or 0  # transformers 5 writes the latter
    if experts and (text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1):
        return None
    model_type = str(text.get("model_type", ""))
    return Shape(
        hidden=text["hidden_size"],
        layers=text["num_hidden_layers"],
        heads=text["num_attention_heads"],
        kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
        intermediate=text.get("intermediate_size", 0),
        vocab=text.get("vocab_size") or cfg["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qkv_bias=bool(text.get("attention_bias", model_type.startswith("qwen2"))),
        head_dim=text.get("head_dim"),
        qk_norm=model_type.startswith("qwen3"),
        experts=experts,
        experts_per_token=text.get("num_experts_per_tok", 0) if experts else 0,
        expert_intermediate=text.get("moe_intermediate_size", text.get("intermediate_size", 0)) if experts else 0,
    )


def known_shape(path: str) -> Shape | None:
    """The published shape of a Qwen2.5 or Qwen3 MoE hub id (Qwen/Qwen2.5-7B-Instruct -> 7b,
    Qwen/Qwen3-VL-30B-A3B-Instruct -> 30b-a3b's decoder), else None."""
    name = path.rsplit("/", 1)[-1].lower()
    if m := re.fullmatch(r"qwen2\.5-(\d+(?:\.\d+)?b)(-instruct)?", name):
        return QWEN25.get(m.group(1))
    if m := re.fullmatch(r"qwen3-(?:vl-)?(30b-a3b|235b-a22b)(-instruct|-thinking|-base)?(-2507)?", name):
        return QWEN3_MOE[m.group(1)]
    return None


def find_shape(path: str) -> tuple[Shape | None, str]:
    """(shape, where it came from) for model.path: a local config.json first, then the table; no network."""
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return shape_from_config(json.loads(local.read_text())), str(local)
    shape = known_shape(path)
    family = "Qwen3 MoE" if shape is not None and shape.moe else "Qwen2.5"
    return shape, (f"the published {family} config" if shape else "")


# -------------------------------------------------------------------------------------- estimate


@dataclass(frozen=True)
class Estimate:
    """Bytes per device of each part; `update` and `rollout` are the two phases' peaks."""

    params: float
    grads: float
    optimizer: float
    compute_weights: float
    reference: float
    activations: float
    logits: float
    rollout_extra: float  # vLLM's share, or HF's compute weights + KV cache
    micro_tokens: int  # per rank (a micro-batch's tokens / train.sequence_parallel_size)
    response_tokens: int
    adapter_params: int = 0  # LoRA: what trains (0: every weight)
    sequence_parallel: int = 1
    critic_state: float = 0.0  # PPO's value model: fp32 weights + AdamW moments (resident)
    critic_grads: float = 0.0  # ... and its gradients during the update
    others: tuple[tuple[str, float], ...] = ()  # the other models held on this device: (label, bytes)

    @property
    def held(self) -> float:
        return sum(b for _, b in self.others)

    @property
    def critic(self) -> float:
        return self.critic_state + self.critic_grads

    @property
    def update(self) -> float:
        return (self.params + self.grads + self.optimizer + self.compute_weights + self.reference + self.critic
                + self.held + self.activations + self.logits)  # fmt: skip

    @property
    def rollout(self) -> float:
        return self.params + self.optimizer + self.reference + self.critic_state + self.held + self.rollout_extra

    @property
    def peak(self) -> float:
        return max(self.update, self.rollout)


def activation_bytes_per_token_layer(shape: Shape, b: int) -> int:
    """A = b (2h + 3q + 3k + M) + 8h, M = 4i dense, K (2h + 4 i_e) + E MoE, plus 4 E (the router's
    fp32 softmax) and 4 (q + k) for Qwen3's q / k norms (module docstring); q = h gives b (5h + 3k + 4i) + 8h."""
    h, q, k = shape.hidden, shape.q_dim, shape.kv_dim
    if shape.moe:
        E, K = shape.experts, shape.experts_per_token
        mlp, extra = K * (2 * h + 4 * shape.expert_intermediate) + E, 4 * E
    else:
        mlp, extra = 4 * shape.intermediate, 0
    norms = 4 * (q + k) if shape.qk_norm else 0
    return b * (2 * h + 3 * q + 3 * k + mlp) + 8 * h + extra + norms


def tokens_that_fit(shape: Shape, free_bytes: int, b: int = 4) -> int:
    """Tokens of one forward + backward with log-probs at every position (serve-tinker's forward_backward) whose
    activations and logits fit in half of `free_bytes`: per token L A (above) and five [V] rows of logits (the
    base's, an adapted unembedding's delta, their sum, the log-softmax chunk, the gradient), times 1.5 for what
    the estimate leaves out (measured on SmolLM2-135M with LoRA on every projection and the unembedding, fp32:
    3.3 MB a token, the estimate 2.3 MB). At least 256."""
    per_token = 1.5 * (shape.layers * activation_bytes_per_token_layer(shape, b) + 5 * shape.vocab * 4)
    return max(256, int(free_bytes / 2 / per_token))


def estimate(
    shape: Shape,
    *,
    world: int,
    strategy: str,
    compute_bytes: int,
    gradient_checkpointing: bool,
    micro_tokens: int,
    response_tokens: int,
    use_ref: bool,
    ref_offload: bool = False,
    engine: str = "vllm",
    gpu_memory_utilization: float = 0.5,
    device_bytes: float = 80 * GiB,
    rollout_sequences: int = 0,
    sequence_len: int = 0,
    logprob_chunk_tokens: int = 1024,
    adapter_params: int = 0,
    sequence_parallel: int = 1,
    critic: bool = False,
) -> Estimate:
    """Per-device bytes of a GRPO step (module docstring: the formulas); `adapter_params` > 0: LoRA;
    `sequence_parallel` u > 1: each rank holds micro_tokens / u and response_tokens / u of a micro-batch;
    `critic`: PPO's value model besides."""
    P, b, a = shape.params(), compute_bytes, adapter_params
    micro_tokens, response_tokens = -(-micro_tokens // sequence_parallel), -(-response_tokens // sequence_parallel)
    sharded = strategy == "fsdp2" and world > 1
    s = 1 / world if sharded else 1.0
    mixed = b < 4
    trained = a or P  # what has fp32 masters, gradients and AdamW moments
    if not mixed:
        weights = 0.0
    elif sharded:
        weights = 2 * 2 * shape.block_params()  # current + prefetched block, bf16
    else:
        weights = 2 * trained  # LoRA: the base computes in its own dtype, only the adapters are cast
    A = activation_bytes_per_token_layer(shape, b)
    if gradient_checkpointing:
        residual = 4 if (mixed and not sharded) else b
        acts = micro_tokens * shape.layers * residual * shape.hidden + micro_tokens * A
    else:
        acts = micro_tokens * shape.layers * A
    if engine == "vllm":
        rollout_extra = gpu_memory_utilization * device_bytes
    else:
        kv = 2 * shape.layers * shape.kv_dim * b * rollout_sequences * sequence_len
        rollout_extra = weights + kv
    return Estimate(
        params=(b * P + 4 * a if a else 4 * P) * s,
        grads=4 * trained * s,
        optimizer=8 * trained * s,
        compute_weights=weights,
        reference=0.0 if (not use_ref or ref_offload) else b * P * s,
        activations=float(acts),
        logits=float(2 * response_tokens * shape.vocab * b + 12 * min(logprob_chunk_tokens, response_tokens) * shape.vocab),
        rollout_extra=rollout_extra,
        micro_tokens=micro_tokens,
        response_tokens=response_tokens,
        adapter_params=a,
        sequence_parallel=sequence_parallel,
        critic_state=12 * critic_params(shape) * s if critic else 0.0,
        critic_grads=4 * critic_params(shape) * s if critic else 0.0,
    )


def critic_params(shape: Shape) -> int:
    """PPO's value model: the policy's backbone (no untied LM head) and a one-label head (held/critic.py)."""
    return shape.params() - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden + 1


def reward_model_params(shape: Shape) -> int:
    """A reward model, a sequence classifier: the backbone (no untied LM head) and a one-logit score head, no bias."""
    return shape.params() - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def other_models(cfg, held, policy_bytes: float) -> tuple[tuple[str, float], ...]:
    """(label, bytes on this device) of the models `held` (assembly.held_models) lists beside the policy, its
    reference and critic: the reward model, the judge, the distillation teacher, async's worker copy (`policy_bytes`: its weights)."""
    rows = []
    rm, judge = cfg.reward.reward_model, cfg.reward.judge
    if held.reward_model:
        dtype = rm.dtype or cfg.model.dtype
        shape, _ = find_shape(rm.path)
        if rm.device != "auto" or rm.offload:
            where = "host memory between calls" if rm.device == "auto" else rm.device
            rows.append((f"reward model (on {where}: not counted here)", 0.0))
        elif shape is None:
            rows.append((f"reward model ({rm.path}: shape unknown, not counted)", 0.0))
        else:
            rows.append((f"reward model ({dtype})", float(DTYPE_BYTES[dtype] * reward_model_params(shape))))
    if held.judge:
        shape, _ = find_shape(judge.path)
        if shape is None:
            rows.append((f"judge ({judge.path}: shape unknown, not counted)", 0.0))
        else:
            rows.append(("judge (float32)", float(4 * shape.params())))
    if held.teacher:  # held as the KL reference is: compute dtype, sharded like it, off the device with ref_offload
        shape, _ = find_shape(cfg.distill.teacher_path)
        if cfg.train.ref_offload:
            rows.append(("teacher (in host memory between passes: not counted here)", 0.0))
        elif shape is None:
            rows.append((f"teacher ({cfg.distill.teacher_path}: shape unknown, not counted)", 0.0))
        else:
            shards = cfg.world_size if cfg.train.strategy == "fsdp2" else 1
            rows.append((f"teacher ({cfg.model.dtype}, frozen)", DTYPE_BYTES[cfg.model.dtype] * shape.params() / shards))
    if held.worker_copy:
        rows.append(("async rollout worker's policy copy", float(policy_bytes)))
    return tuple(rows)


def estimate_for_config(cfg, device_gib: float) -> tuple[Estimate | None, str]:
    """The estimate of a postrl Config on devices of `device_gib` GiB, and a line saying what it is of."""
    from postrl.builtin import pretrained

    gguf = pretrained.gguf_file(cfg.model.path)
    if cfg.model.path.startswith("builtin:") and gguf is None:
        return None, "built-in tiny model: a few MB, no estimate needed"
    if gguf is not None:
        shape, source = shape_from_config(pretrained.gguf_config(gguf)), f"the GGUF header of {gguf.name}"
    else:
        shape, source = find_shape(cfg.model.path)
    if shape is None:
        why = (
            f"{source} describes no dense decoder (MoE?)" if source
            else f"no config.json at {cfg.model.path} and not one of the Qwen2.5 hub ids postrl knows (0.5B-72B)"
        )  # fmt: skip
        return None, f"no memory estimate for {cfg.model.path}: {why}"
    t, d, r, m = cfg.train, cfg.data, cfg.rollout, cfg.model
    if shape.heads % t.sequence_parallel_size:
        divisors = [u for u in range(2, shape.heads + 1) if shape.heads % u == 0 and cfg.world_size % u == 0]
        return None, (
            f"no memory estimate for {m.path}: train.sequence_parallel_size ({t.sequence_parallel_size}) does not divide its "
            f"{shape.heads} attention heads, and Ulysses attention gives each rank of the group a whole share of them. "
            f"Fix: choose one of {divisors or [1]}."
        )
    from postrl.assembly import held_models

    adapters = shape.adapter_params(m.lora_rank, m.target_modules) if m.lora_rank else 0
    held = held_models(cfg)  # the models the trainer builds (a LoRA reference is the base, adapters off)
    seq = d.max_prompt_length + r.max_tokens
    # verl's convention: with sequence parallelism u a dynamic micro-batch holds u x the per-device budget
    micro = t.max_token_len_per_device * t.sequence_parallel_size if t.use_dynamic_bsz else t.micro_batch_size * seq
    world = cfg.world_size
    est = estimate(
        shape, world=world, strategy=t.strategy, compute_bytes=2 if cfg.model.dtype != "float32" else 4,
        gradient_checkpointing=cfg.model.gradient_checkpointing, micro_tokens=micro,
        response_tokens=micro * r.max_tokens // seq, use_ref=held.separate_reference, ref_offload=t.ref_offload,
        engine="hf" if r.engine == "hf" else "vllm", gpu_memory_utilization=r.gpu_memory_utilization,
        device_bytes=device_gib * GiB, rollout_sequences=-(-t.gen_batch_size * r.n_samples_per_prompt // world),
        sequence_len=seq, logprob_chunk_tokens=t.logprob_chunk_tokens, adapter_params=adapters,
        sequence_parallel=t.sequence_parallel_size, critic=held.critic,
    )  # fmt: skip
    b = 2 if cfg.model.dtype != "float32" else 4
    est = replace(est, others=other_models(cfg, held, b * shape.params() + 4 * adapters if adapters else 4 * shape.params()))
    layout = f"{t.strategy} over {world} device(s)" if world > 1 else "one device"
    if t.sequence_parallel_size > 1:
        layout += f", Ulysses sequence parallel {t.sequence_parallel_size}"
    trains = f", LoRA rank {m.lora_rank} ({adapters / 1e6:.1f}M adapter parameters)" if adapters else ""
    moe = ""
    if shape.moe:
        moe = (
            f" ({shape.params(active=True) / 1e9:.2f}B active: {shape.experts_per_token} of {shape.experts} experts "
            f"per token; every expert sharded by {t.strategy if world > 1 else 'nothing on one device'})"
        )
    what = (
        f"{m.path}: {shape.params() / 1e9:.2f}B parameters{moe} ({source}){trains}, {layout}, {m.dtype} compute, "
        f"gradient checkpointing {'on' if m.gradient_checkpointing else 'off'}"
    )
    return est, what


def report(
    est: Estimate, what: str, device_gib: float, engine: str, gpu_memory_utilization: float, assumed: bool = False
) -> list[str]:
    """The lines check-config prints: one row per part, the two phases' peaks, and whether they fit
    (`assumed`: no GPU here, `device_gib` is the default GPU size, and the verdict says so)."""
    rollout = f"vLLM's share {gpu_memory_utilization:g} x {device_gib:g} GiB" if engine != "hf" else "compute weights + KV cache"
    trained = " of the adapters" if est.adapter_params else ""
    rows = [
        ("parameters (frozen base + fp32 adapters)" if est.adapter_params else "parameters (fp32 masters)", est.params),
        (f"gradients{trained} (fp32)", est.grads),
        (f"optimizer{trained} (AdamW: 2 fp32 moments)", est.optimizer),
        ("compute weights (half-precision copies)", est.compute_weights),
        ("reference model", est.reference),
        *([("critic (PPO value model: fp32 weights, gradients, AdamW)", est.critic)] if est.critic else []),
        *est.others,
        (f"activations ({est.micro_tokens:,} tokens / micro-batch{' / rank' if est.sequence_parallel > 1 else ''})", est.activations),
        (f"log-prob logits ({est.response_tokens:,} response tokens)", est.logits),
        ("= update peak", est.update),
        (f"rollout peak (resident state + {rollout})", est.rollout),
    ]
    lines = [f"memory per device (estimate; {what}):"]
    lines += [f"  {label:<58} {value / GiB:9.2f} GiB" for label, value in rows]
    fits = est.peak <= device_gib * GiB
    lines.append(f"  {'fits' if fits else 'does NOT fit'} in {device_gib:g} GiB per device (peak {est.peak / GiB:.1f} GiB)")
    if assumed:
        lines.append(
            f"  (no GPU on this machine: {device_gib:g} GiB GPUs assumed, --device-memory GIB for others; a CPU run "
            "holds the same state in host memory, and vLLM on CPU takes rollout.kv_cache_space_gb, not a GPU share)"
        )
    if not fits:
        lines.append(
            "  Fix: more devices with train.strategy: fsdp2 (cluster.devices_per_node / nnodes), "
            "model.gradient_checkpointing: true, a smaller train.max_token_len_per_device or micro_batch_size, "
            "train.ref_offload: true, a lower rollout.gpu_memory_utilization, or LoRA adapters (model.lora_rank: 64)."
        )
    return lines
