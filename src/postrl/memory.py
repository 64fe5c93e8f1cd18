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
Activations of one micro-batch of N tokens (the update pass; the log-prob passes keep none):
  per token and layer, what autograd saves for a Qwen2/Llama block with flash / SDPA attention (no
  [T x T] scores): normed inputs of attention and MLP (2h), q, k, v (h + 2k), q and k after RoPE
  (h + k), attention output (h), gate, up, silu(gate), and their product (4i), in the compute
  dtype, plus the two RMSNorms' fp32 inputs (2 x 4h bytes):
      A = b (5h + 3k + 4i) + 8h   bytes per token per layer
  without checkpointing: N L A; with model.gradient_checkpointing (each layer's input kept, one
  layer recomputed at a time): N L r h + N A, r = 4 (fp32 residual stream under autocast) or b.
Log-prob logits of one micro-batch's N_r response tokens (models.response_logprobs): the logits
  in the compute dtype, kept for backward, and their gradient beside them in backward (2 N_r V b);
  the fp32 log-softmax runs over chunks of C = min(train.logprob_chunk_tokens, N_r) tokens, three
  fp32 [C x V] tensors at a time (scaled logits, softmax, gradient; algorithms.token_logprobs):
      2 N_r V b + 12 C V  bytes.
  N = micro_batch_size x (max_prompt_length + max_tokens), or max_token_len_per_device with dynamic
  batch size; N_r = the response share of N, N x max_tokens / (max_prompt_length + max_tokens).
LoRA (model.lora_rank r > 0, adapters on a of the 7 projections, A = L r sum over them of in + out):
  parameters b P s + 4 A s (the frozen base in the compute dtype, fp32 adapters)   gradients 4 A s
  optimizer 8 A s   compute weights: 2 A on one device or DDP (the base computes as it is), the
  gathered blocks under FSDP2   reference 0 (the base with adapters off, unless
  checkpoint.ref_model_path names another model); activations as above.
Rollout, on top of the resident state less the gradients (freed before each rollout):
  vLLM: its share of the device, gpu_memory_utilization x device memory (weights, KV cache, graphs;
  asleep during the update). HF generate: the compute weights and a KV cache of 2 L k b bytes per
  token for this rank's gen_batch_size x n / W sequences of max_prompt_length + max_tokens tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
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

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    def block_params(self) -> int:
        """One decoder layer: q, k, v, o projections, gated MLP, two RMSNorm weights."""
        h, q, k, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = h * q + 2 * h * k + q * h + ((q + 2 * k) if self.qkv_bias else 0)
        return attn + 3 * h * i + 2 * h

    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.block_params() + self.hidden

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of a decoder layer's linear layers, by module name (LoRA's targets)."""
        h, q, k, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

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


def shape_from_config(cfg: dict) -> Shape | None:
    """The Shape of a config.json (a VLM's text model for Qwen2.5-VL); None for what it cannot describe (MoE)."""
    text = cfg.get("text_config") or cfg
    if "num_experts" in text or "num_local_experts" in text or "hidden_size" not in text:
        return None
    return Shape(
        hidden=text["hidden_size"],
        layers=text["num_hidden_layers"],
        heads=text["num_attention_heads"],
        kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
        intermediate=text["intermediate_size"],
        vocab=text.get("vocab_size") or cfg["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qkv_bias=bool(text.get("attention_bias", str(text.get("model_type", "")).startswith("qwen2"))),
        head_dim=text.get("head_dim"),
    )


def known_shape(path: str) -> Shape | None:
    """The published shape of a Qwen2.5 hub id (Qwen/Qwen2.5-7B-Instruct -> 7b), else None."""
    m = re.fullmatch(r"qwen2\.5-(\d+(?:\.\d+)?b)(-instruct)?", path.rsplit("/", 1)[-1].lower())
    return QWEN25.get(m.group(1)) if m else None


def find_shape(path: str) -> tuple[Shape | None, str]:
    """(shape, where it came from) for model.path: a local config.json first, then the table; no network."""
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return shape_from_config(json.loads(local.read_text())), str(local)
    shape = known_shape(path)
    return shape, ("the published Qwen2.5 config" if shape else "")


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
    micro_tokens: int
    response_tokens: int
    adapter_params: int = 0  # LoRA: what trains (0: every weight)

    @property
    def update(self) -> float:
        return self.params + self.grads + self.optimizer + self.compute_weights + self.reference + self.activations + self.logits

    @property
    def rollout(self) -> float:
        return self.params + self.optimizer + self.reference + self.rollout_extra

    @property
    def peak(self) -> float:
        return max(self.update, self.rollout)


def activation_bytes_per_token_layer(shape: Shape, b: int) -> int:
    """A = b (5h + 3k + 4i) + 8h (module docstring)."""
    h, k, i = shape.hidden, shape.kv_dim, shape.intermediate
    return b * (5 * h + 3 * k + 4 * i) + 8 * h


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
) -> Estimate:
    """Per-device bytes of a GRPO step (module docstring: the formulas); `adapter_params` > 0: LoRA."""
    P, b, a = shape.params(), compute_bytes, adapter_params
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
    )


def estimate_for_config(cfg, device_gib: float) -> tuple[Estimate | None, str]:
    """The estimate of a postrl Config on devices of `device_gib` GiB, and a line saying what it is of."""
    if cfg.model.path.startswith("builtin:"):
        return None, "built-in tiny model: a few MB, no estimate needed"
    shape, source = find_shape(cfg.model.path)
    if shape is None:
        why = (
            f"{source} describes no dense decoder (MoE?)" if source
            else f"no config.json at {cfg.model.path} and not one of the Qwen2.5 hub ids postrl knows (0.5B-72B)"
        )  # fmt: skip
        return None, f"no memory estimate for {cfg.model.path}: {why}"
    t, d, r, m = cfg.train, cfg.data, cfg.rollout, cfg.model
    adapters = shape.adapter_params(m.lora_rank, m.target_modules) if m.lora_rank else 0
    # a KL reference of its own: with LoRA the reference is the base (adapters off), unless ref_model_path names one
    separate_ref = cfg.algorithm.kl.coef > 0 and (not m.lora_rank or bool(cfg.checkpoint.ref_model_path))
    seq = d.max_prompt_length + r.max_tokens
    micro = t.max_token_len_per_device if t.use_dynamic_bsz else t.micro_batch_size * seq
    world = cfg.world_size
    est = estimate(
        shape, world=world, strategy=t.strategy, compute_bytes=2 if cfg.model.dtype != "float32" else 4,
        gradient_checkpointing=cfg.model.gradient_checkpointing, micro_tokens=micro,
        response_tokens=micro * r.max_tokens // seq, use_ref=separate_ref, ref_offload=t.ref_offload,
        engine="hf" if r.engine == "hf" else "vllm", gpu_memory_utilization=r.gpu_memory_utilization,
        device_bytes=device_gib * GiB, rollout_sequences=-(-t.gen_batch_size * r.n_samples_per_prompt // world),
        sequence_len=seq, logprob_chunk_tokens=t.logprob_chunk_tokens, adapter_params=adapters,
    )  # fmt: skip
    layout = f"{t.strategy} over {world} device(s)" if world > 1 else "one device"
    trains = f", LoRA rank {m.lora_rank} ({adapters / 1e6:.1f}M adapter parameters)" if adapters else ""
    what = (
        f"{m.path}: {shape.params() / 1e9:.2f}B parameters ({source}){trains}, {layout}, {m.dtype} compute, "
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
        (f"activations ({est.micro_tokens:,} tokens / micro-batch)", est.activations),
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
