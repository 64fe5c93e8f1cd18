"""Run configuration: pydantic models of every section, YAML loading and dotted CLI overrides.

Names follow the MindSpeed-RL / verl guides so users can carry their settings over. Every field has
a docstring-like `description`. Values left as None are derived in one place, right after parsing
(`Config._derive`): `algorithm.name: dapo` switches on DAPO's defaults (clip-higher 0.28,
token-mean, overlong buffer, filter_groups, no KL), and every DAPO piece also works alone under GRPO.

`load_config` reports every problem at once (what, why, how to fix) as a `UserError`.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from postrl.builtin.knobs import BuiltinTaskConfig, ShapesTaskConfig, ToolArithmeticConfig
from postrl.errors import UserError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, protected_namespaces=())


# --------------------------------------------------------------------------------------------- model
class ModelConfig(Section):
    path: str = Field(
        description="Hugging Face model directory or hub id (e.g. Qwen/Qwen2.5-7B-Instruct, "
        "Qwen/Qwen2.5-VL-7B-Instruct), or 'builtin:tiny-qwen2' / 'builtin:tiny-qwen2.5-vl' for the built-in "
        "tiny text / vision-language model (built locally and cached), 'builtin:tiny-qwen3-moe' for a tiny "
        "mixture-of-experts model."
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer/processor location; defaults to `path`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Compute dtype. bfloat16 (the guides' choice on GPUs) keeps fp32 master weights, gradients and "
        "AdamW moments and runs the forward passes in bf16 (autocast on one device or DDP, FSDP2 mixed precision "
        "with fp32 gradient reduction); log-probs and losses stay fp32. The reference model and the vLLM engine hold "
        "bf16 weights. float32: everything fp32 (the CPU default). float16: as bfloat16, with dynamic loss scaling "
        "(fp16's narrow exponent would flush small gradients; docs/gpu.md).",
    )
    trust_remote_code: bool = Field(False, description="Passed to from_pretrained; keep false unless you trust the repo.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    attn_implementation: str = Field(
        "auto",
        description="Attention kernels (transformers' attn_implementation): auto (flash_attention_2 for bf16 / fp16 "
        "compute on CUDA where the flash-attn package is installed, else sdpa), sdpa, eager, flex_attention, flash_attention_2, "
        "flash_attention_3, or a kernels hub repo such as kernels-community/flash-attn3. With flash attention, "
        "train.use_remove_padding packs a micro-batch into one row for the varlen kernels (docs/performance.md).",
    )
    freeze_vision_tower: bool = Field(True, description="VLMs: keep the vision encoder frozen during RL.")
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="MoE models (Qwen3-MoE, Qwen3-VL-MoE): weight of the routers' load-balancing loss added to the "
        "policy loss (Switch Transformer's, as transformers computes it); null: the model's config.json value "
        "(Qwen3-MoE: 0.001); 0: off. The loss and the per-expert load are logged as moe/* either way.",
    )
    lora_rank: int = Field(
        0,
        ge=0,
        description="LoRA rank (verl's lora_rank). 0: every weight trains. > 0: low-rank adapters on target_modules "
        "train (fp32) and the base stays frozen in model.dtype, with no gradients or AdamW state; the KL reference is "
        "the base itself (adapters off), and rollout, checkpoints and export get the merged weights (docs/gpu.md: "
        "the 7B recipe on one GPU).",
    )
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scale numerator: the adapters add (lora_alpha / lora_rank) x B A.")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get LoRA adapters (peft names): all-linear (every linear layer but the LM head, "
        "and not a frozen vision tower) or a list such as [q_proj, k_proj, v_proj, o_proj].",
    )
    tiny: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides of the tiny model factory (hidden_size, num_layers, vocab_size, seed, ...) "
        "when path is 'builtin:tiny-qwen2' or 'builtin:tiny-qwen2.5-vl' (also vision_depth, min_pixels, ...).",
    )

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, v: str) -> str:
        known = ("auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
        if v in known or "/" in v:  # org/repo: a kernel from the hub, which transformers resolves
            return v
        raise ValueError(f"unknown attention implementation '{v}'; valid: {', '.join(known)}, or a kernels hub repo (org/name)")


# ---------------------------------------------------------------------------------------------- data
class DataConfig(Section):
    train_files: list[str] = Field(
        default_factory=lambda: ["builtin:arithmetic:train"],
        description="Parquet/JSONL files in the verl schema, or 'builtin:arithmetic:train'.",
    )
    val_files: list[str] = Field(
        default_factory=lambda: ["builtin:arithmetic:val"], description="Held-out files for validation."
    )
    prompt_key: str = Field("prompt", description="Column holding the chat messages (or a plain string).")
    answer_key: str = Field("reward_model.ground_truth", description="Dotted path of the ground truth in a row.")
    response_key: str = Field("extra_info.solution", description="Dotted path of the reference response (SFT).")
    image_key: str = Field(
        "images",
        description="Column holding a row's images (bytes, paths or {bytes, path}; one '<image>' placeholder "
        "in the prompt per image). Rows without it are text-only.",
    )
    min_pixels: int | None = Field(
        None, ge=1, description="Images smaller than this many pixels are upscaled (default: the processor's)."
    )
    max_pixels: int | None = Field(
        None, ge=1, description="Images larger than this many pixels are downscaled (default: the processor's)."
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip and count malformed image rows (missing file, undecodable bytes, placeholder count != "
        "image count) instead of stopping with an error that names the row.",
    )
    max_prompt_length: int = Field(512, ge=1, description="Prompts longer than this (tokens) are dropped.")
    filter_overlong_prompts: bool = Field(True, description="Drop overlong prompts (else: error).")
    shuffle: bool = Field(True, description="Shuffle the training prompts every epoch.")
    seed: int = Field(0, description="Seed of the shuffle.")
    builtin: BuiltinTaskConfig = Field(default_factory=BuiltinTaskConfig, description="Built-in task knobs.")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # verl writes data.train_files=$HOME/data/train.parquet
    shapes: ShapesTaskConfig = Field(default_factory=ShapesTaskConfig, description="Built-in visual task knobs.")
    tool_arithmetic: ToolArithmeticConfig = Field(
        default_factory=ToolArithmeticConfig, description="Knobs of the built-in task where tools matter."
    )


# ------------------------------------------------------------------------------------------- rollout
class MultiTurnConfig(Section):
    """The agent loop (docs/agents.md): the model calls tools and talks to an environment between its turns.

    verl's names (actor_rollout_ref.rollout.multi_turn) are accepted as aliases where they mean the same.
    """

    enable: bool = Field(False, description="Roll out with the agent loop (tools, environments) instead of one generate call.")
    max_turns: int = Field(
        4, ge=1, validation_alias=AliasChoices("max_turns", "max_assistant_turns"),
        description="Most model turns per trajectory (verl: max_assistant_turns).",
    )  # fmt: skip
    max_user_turns: int = Field(
        4, ge=0, description="Most environment observations appended as user turns per trajectory (verl's name)."
    )
    max_tool_calls: int = Field(8, ge=0, description="Most tool calls per trajectory; a turn past it ends the trajectory.")
    max_parallel_calls: int = Field(
        4, ge=1, description="Most tool calls run from one model turn; further calls in it are answered with an error."
    )
    max_response_tokens: int | None = Field(
        None, ge=1,
        description="Total budget of response tokens across turns (model, tool and environment tokens); "
        "default rollout.max_tokens (eval.max_tokens in validation), which it cannot exceed.",
    )  # fmt: skip
    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call: 'builtin:python', 'builtin:calculator' or 'package.module:function' "
        "(JSON schema from its type hints and docstring).",
    )
    tool_timeout_s: float = Field(10.0, gt=0, description="Time limit of one tool call; past it the model reads a timeout message.")
    max_tool_response_tokens: int = Field(
        256, ge=1, validation_alias=AliasChoices("max_tool_response_tokens", "max_tool_response_length"),
        description="A tool's output is cut to this many tokens before it is shown to the model (verl: max_tool_response_length).",
    )  # fmt: skip
    tool_workers: int = Field(8, ge=1, description="Tool calls run concurrently across trajectories on this many threads.")
    interaction: str | None = Field(
        None,
        description="Environment 'package.module:Class' with reset(row) and step(assistant_text) -> (observation, "
        "reward, done); its observations are appended as user turns and its rewards add to the verifier score.",
    )


class RolloutConfig(Section):
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="Rollout engine: vllm when it imports and supports the model (auto), else hf."
    )
    n_samples_per_prompt: int = Field(
        8,
        ge=2,
        description="Completions per prompt (the GRPO group size); at least 2, because each advantage is "
        "measured against the other samples of its group and a group of one has none",
    )
    max_tokens: int = Field(256, ge=1, description="Maximum response tokens (the guides' rollout_max_tokens).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; log-probs use the same scaling.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling; -1 disables.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM on GPU: fraction of memory it may use.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism.")
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="MoE models: vLLM expert parallelism (verl's rollout.expert_parallel_size). vLLM spreads the experts "
        "over the engine's tensor-parallel ranks instead of slicing each one (enable_expert_parallel), so it must be 1 "
        "or equal to tensor_parallel_size (each colocated engine is one tensor-parallel group; rollout data "
        "parallelism is the engines side by side).",
    )
    kv_cache_space_gb: float = Field(1.0, gt=0, description="vLLM on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    max_num_seqs: int = Field(256, ge=1, description="vLLM: sequences in flight.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="vLLM: tokens one scheduler step may process (prefill chunk size); default vLLM's."
    )
    enable_sleep_mode: bool = Field(True, description="vLLM on GPU: sleep the engine during the policy update.")
    enforce_eager: bool = Field(
        False,
        description="vLLM: run the model eagerly. False (vLLM's default) compiles it once at start (torch.compile, "
        "and CUDA graphs on GPU): on CPU about 30 s more at the first start and a few seconds once its caches are warm, for decode "
        "steps ~1.4x faster on small models (docs/performance.md). True: no compile (short runs, debugging, no C++ "
        "compiler on a CPU machine).",
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="The agent loop: tools, environments.")
    agent: str | None = Field(
        None, description="A user's agent program as the rollout: 'package.module:function' or 'path/file.py:function', "
        "sync or async, called once per sample with an openai client pointed at postrl's OpenAI-compatible endpoint and "
        "the dataset row; returns a reward (added to the verifiers' score) or None (docs/agents.md).",
    )
    agent_concurrency: int = Field(64, ge=1, description="rollout.agent: programs running at once.")
    agent_timeout_s: float = Field(300.0, gt=0, description="rollout.agent: time limit per sample; a program past it scores 0.")
    agent_batch_wait_ms: float = Field(
        20.0, ge=0, description="rollout.agent: the endpoint samples the requests it holds once every running program "
        "waits on one, or when none arrived for this long (at most 10x this after the first).",
    )
    agent_host: str = Field("127.0.0.1", description="rollout.agent: the endpoint's address (loopback unless set).")
    agent_port: int = Field(0, ge=0, le=65535, description="rollout.agent: the endpoint's port (0: a free one).")
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: generate, score, update, sync weights, in lock-step with the engine colocated. async: a "
        "rollout worker process generates and scores the next batches while the trainer updates, within "
        "rollout.max_staleness policy versions (docs/async.md; one trainer process).",
    )
    max_staleness: int = Field(
        0, ge=0, description="Async rollout: the oldest policy version a trained sequence may come from, in updates "
        "behind the trainer (async/staleness_max): 0 on-policy (async reproduces sync), 1 one-step-off, k bounded. "
        "Sync mode is always 0.",
    )
    partial_rollout: bool = Field(
        False, description="Async rollout: generation in flight when new weights arrive continues under them (in chunks "
        "of partial_rollout_chunk tokens) instead of finishing under the old ones; every token records its version.",
    )
    partial_rollout_chunk: int = Field(16, ge=1, description="Partial rollout: tokens generated between two looks for new weights.")
    max_worker_restarts: int = Field(
        1, ge=0, description="Async rollout: times a dead or failing rollout worker is restarted from the trained position "
        "before the run stops with a checkpoint.",
    )

    @model_validator(mode="after")
    def _async_keys(self) -> "RolloutConfig":
        if self.mode == "sync" and self.max_staleness != 0:
            raise ValueError(
                f"rollout.max_staleness is {self.max_staleness}, but synchronous rollout always trains on the current "
                "policy's samples (staleness 0). Fix: set rollout.mode: async to let rollout run ahead, or leave "
                "rollout.max_staleness at 0."
            )
        if self.partial_rollout and self.mode == "sync":
            raise ValueError(
                "rollout.partial_rollout continues generations across weight updates, which only happen mid-generation "
                "in async mode. Fix: set rollout.mode: async, or rollout.partial_rollout: false."
            )
        if self.agent and self.multi_turn.enable:
            raise ValueError(
                "rollout.agent and rollout.multi_turn.enable both say how to roll out: the user's program through the "
                "endpoint, or postrl's own agent loop. Fix: keep one (the program calls its own tools)."
            )
        if self.partial_rollout and self.multi_turn.enable:
            raise ValueError(
                "rollout.partial_rollout is not built for agent trajectories (rollout.multi_turn): their turns would "
                "need per-turn versions through the agent loop. Fix: set rollout.partial_rollout: false (async mode "
                "still runs the agent loop, each trajectory under one version)."
            )
        return self


# ----------------------------------------------------------------------------------------- algorithm
def _registered_name(kind: str, value: str, registry: str | tuple[str, ...], user_fn: bool = False) -> str:
    """`value` if postrl.algorithms registers it in `registry`; else a ValueError with the valid names
    (and, with `user_fn`, the 'package.module:function' alternative).

    The names live only in algorithms/; it is imported here, not at module import, so that loading
    this module does not import torch.
    """
    from postrl import algorithms

    valid = [name for r in (registry if isinstance(registry, tuple) else (registry,)) for name in getattr(algorithms, r)]
    if value not in valid:
        guess = difflib.get_close_matches(str(value), valid, n=1)
        hint = f" Did you mean '{guess[0]}'?" if guess else ""
        own = ", or name your own function as 'package.module:function'" if user_fn else ""
        raise ValueError(f"unknown {kind} '{value}'.{hint} Valid: {', '.join(valid)}. Fix: choose one of them{own}.")
    return value


class KLConfig(Section):
    coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss; 0 = no reference model.")
    estimator: str = Field("k3", description="KL estimator: k1, k2, k3, abs, low_var_kl (= k3, the guides' name).")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        return _registered_name("KL estimator", v, "KL_ESTIMATORS")


class KLControlConfig(Section):
    type: Literal["fixed"] = Field("fixed", description="fixed: a constant coefficient (verl's adaptive controller is not here).")
    kl_coef: float = Field(0.001, ge=0, description="Weight of the per-token KL penalty in the reward (use_kl_in_reward).")


class RolloutCorrectionConfig(Section):
    """Importance weights for the gap between the rollout engine's log-probs and the trainer's (docs/algorithms.md)."""

    enable: bool = Field(
        False, description="Weight the policy loss by the engine-vs-trainer importance ratio (on by default in async "
        "mode with rollout.max_staleness >= 1: AReaL's decoupled objective).",
    )
    level: str = Field(
        "token",
        description="A level registered in postrl.algorithms (docs/algorithms.md): token (TIS: per-token weight "
        "min(p/q, cap)), sequence (MIS: reject sequences whose ratio prod_t p/q lies outside [1/cap, cap]), seq_mis "
        "(MIS, kept sequences weighted by their ratio), icepop (reject tokens whose p/q lies outside [1/cap, cap]), "
        "geo_rs (reject sequences whose geometric-mean ratio lies outside [1/cap, cap]). Rejected tokens leave the "
        "loss and its normalisers; a rejecting level computes the old log-probs in their own pass.",
    )
    cap: float = Field(
        2.0, gt=1, description="Truncation cap (token) or bound of the accepted ratio range (the others; geo_rs wants "
        "one near 1, e.g. 1.002); must exceed 1.",
    )

    @field_validator("level")
    @classmethod
    def _known_level(cls, v: str) -> str:
        return _registered_name("rollout correction level", v, "ROLLOUT_CORRECTIONS")


class OverlongBufferConfig(Section):
    enable: bool | None = Field(None, description="DAPO overlong reward shaping (default: on for dapo).")
    len: int = Field(64, ge=1, description="Buffer length B: penalty starts at max_tokens - B.")
    penalty_factor: float = Field(1.0, ge=0, description="Penalty at max_tokens.")


class FilterGroupsConfig(Section):
    enable: bool | None = Field(None, description="DAPO dynamic sampling (default: on for dapo).")
    metric: str = Field("acc", description="Raw verifier metric whose zero-std groups are dropped.")
    max_num_gen_batches: int = Field(
        10, description="Give up after this many generation batches per step; <= 0 means no limit."
    )


# What `algorithm.name` sets when a key is left unset. A policy loss's own preferences (declared with its
# registration in algorithms/) win over these, and an explicit setting over both.
ALGORITHM_NAME_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg_mode": "seq-mean-token-mean"},
    "dapo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},  # clip-higher, token-level loss
}


def _policy_loss_args(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Every param policy loss `name` declares, from `args` (coerced, range-checked) or its default.

    A ValueError holds one paragraph per problem: an unknown key lists the valid ones, a bad value its range.
    """
    from pydantic import create_model

    from postrl import algorithms

    params = algorithms.policy_loss_spec(algorithms.get_policy_loss_fn(name)).params
    fields = {
        k: (type(p.default), Field(p.default, ge=p.ge, gt=p.gt, le=p.le, lt=p.lt, description=p.doc)) for k, p in params.items()
    }
    model = create_model("PolicyLossArgs", __config__=ConfigDict(extra="forbid"), **fields)
    try:
        return model.model_validate(args).model_dump()
    except ValidationError as exc:
        errors = exc.errors()
    valid = "; ".join(f"{k} ({p.range_text(k)}, default {p.default!r}: {p.doc.rstrip('.')})" for k, p in params.items())
    problems = []
    for err in errors:
        key = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            guess = difflib.get_close_matches(key, list(params), n=1)
            hint = f" Did you mean '{guess[0]}'?" if guess else ""
            takes = f"Valid keys: {valid}." if params else "It declares no arguments."
            problems.append(
                f"unknown key '{key}' for policy loss '{name}'.{hint} {takes} Fix: use one of the keys it declares, "
                "or remove the key."
            )
        else:
            p = params[key]
            problems.append(
                f"{key} = {err.get('input')!r} is not valid for policy loss '{name}': {err['msg'][0].lower()}{err['msg'][1:]}. "
                f"{key} must be {type(p.default).__name__} with {p.range_text(key)} ({p.doc.rstrip('.')}). "
                f"Fix: set algorithm.policy_loss_args.{key} within that range, or leave it out for the default {p.default!r}."
            )
    raise ValueError("\n".join(problems))


class AlgorithmConfig(Section):
    name: Literal["grpo", "dapo"] = Field("grpo", description="grpo or dapo; dapo only changes defaults.")
    adv_estimator: str = Field(
        "grpo",
        description="Advantage estimator: grpo, drgrpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, "
        "or gae (PPO: a critic, see the `critic` section, gives per-token GAE advantages; docs/algorithms.md).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE: discount per model token (verl's algorithm.gamma).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE: lambda, the bias-variance trade-off (verl's algorithm.lam).")
    use_kl_in_reward: bool = Field(
        False,
        description="PPO (gae) only: subtract kl_ctrl.kl_coef x KL(policy || reference) (estimator algorithm.kl.estimator) "
        "from the reward of every model token, as verl's use_kl_in_reward; loads the reference model.",
    )
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, description="KL-in-reward coefficient.")
    policy_loss: str | None = Field(
        None,
        description="Policy loss: a name registered in postrl.algorithms (docs/algorithms.md lists each with its "
        "arguments and preferred defaults) or your own 'package.module:function' (docs/algorithms.md, \"Writing your "
        "own loss\"). Default: the registry's default, the PPO clipped surrogate.",
    )
    policy_loss_args: dict[str, Any] = Field(
        default_factory=dict,
        validate_default=True,
        description="The policy loss's own hyperparameters, as it declares them (name, range, default); unset ones "
        "take the loss's defaults. An unknown key or an out-of-range value is an error.",
    )
    norm_adv_by_std: bool = Field(True, description="Divide advantages by the group std (false: Dr. GRPO).")
    epsilon: float = Field(1e-6, gt=0, description="Added to the group std.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL loss to the reference model.")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="Rollout-engine importance correction (TIS / MIS)."
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (subtracted from the loss).")
    clip_ratio_low: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="eps_low: ratio clipped below at 1 - eps_low (default: the policy loss's preference, else 0.2).",
    )
    clip_ratio_high: float | None = Field(
        None,
        gt=0,
        description="eps_high: ratio clipped above at 1 + eps_high (default: the policy loss's preference, else 0.28 "
        "for dapo and 0.2 for grpo).",
    )
    clip_ratio_c: float | None = Field(
        3.0,
        gt=1,
        description="Dual-clip constant c for A < 0: the loss is capped at -A*c. It must exceed 1, since "
        "at c <= 1 the cap would undercut the ordinary clipped objective; null disables dual clip",
    )
    loss_agg_mode: str | None = Field(
        None,
        description="Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm "
        "(default: the policy loss's preference, else token-mean for dapo and seq-mean-token-mean for grpo).",
    )
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig, description="Overlong shaping.")
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, description="Dynamic sampling.")

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        return _registered_name("advantage estimator", v, ("ADV_ESTIMATORS", "CRITIC_ADV_ESTIMATORS"))

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, v: str | None) -> str | None:
        if v is None or ":" not in v:
            return v if v is None else _registered_name("policy loss", v, "POLICY_LOSSES", user_fn=True)
        from postrl import algorithms

        algorithms.get_policy_loss_fn(v)  # imports the user's module: a ValueError says why it failed
        return v

    @field_validator("policy_loss_args")
    @classmethod
    def _declared_args(cls, v: dict[str, Any], info) -> dict[str, Any]:
        # Checked against what the chosen loss declares, and filled with its defaults, so that
        # check-config shows every value the loss will be called with.
        if "policy_loss" not in info.data:
            return v  # the loss itself is invalid, and reported
        from postrl import algorithms

        return _policy_loss_args(info.data["policy_loss"] or algorithms.DEFAULT_POLICY_LOSS, v)

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_agg_mode(cls, v: str | None) -> str | None:
        return v if v is None else _registered_name("loss_agg_mode", v, "LOSS_AGGREGATIONS")

    def _derive(self) -> None:
        from postrl import algorithms

        if self.policy_loss is None:
            self.policy_loss = algorithms.DEFAULT_POLICY_LOSS
        # The policy loss's paper settings win over the algorithm name's, explicit values over both.
        loss_prefers = algorithms.policy_loss_spec(algorithms.get_policy_loss_fn(self.policy_loss)).defaults
        for key, value in {**ALGORITHM_NAME_DEFAULTS[self.name], **loss_prefers}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        dapo = self.name == "dapo"
        if self.overlong_buffer.enable is None:
            self.overlong_buffer.enable = dapo
        if self.filter_groups.enable is None:
            self.filter_groups.enable = dapo
        if self.kl.estimator == "low_var_kl":
            self.kl.estimator = "k3"


# ------------------------------------------------------------------------------------------- reward
class VerifierSpec(Section):
    name: str = Field(description="Registered verifier name or 'package.module:function'.")
    weight: float = Field(1.0, description="Weight in the summed reward.")


class RewardModelConfig(Section):
    path: str = Field(
        description="A Hugging Face sequence-classification model with one logit (the public reward models' format, "
        "e.g. Skywork-Reward), or the output of `postrl rm`. It scores prompt + response rendered with its own "
        "tokenizer and chat template."
    )
    weight: float = Field(1.0, description="Weight of the (normalised) RM score in the summed reward.")
    normalize: bool = Field(
        True,
        description="Use (score - mean) / std over the generation batch (all ranks) as the RM reward, so its scale "
        "matches the rule rewards'. The raw score is logged as rm_score (<algo>/score when an RM is on).",
    )
    micro_batch_size: int = Field(16, ge=1, description="Sequences per RM forward pass.")
    max_length: int = Field(1024, ge=8, description="Longer prompt + response are cut from the left (the response end is kept).")
    device: str = Field("auto", description="auto: the run's device; or cpu / cuda:N (an RM on a device of its own).")
    offload: bool = Field(False, description="Keep the RM in host memory between scoring calls (moved to the device to score).")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="RM weights' dtype (default model.dtype).")


class JudgeConfig(Section):
    path: str = Field(description="A causal LM (Hugging Face directory or hub id) that judges each response.")
    prompt_template: str = Field(
        "Question: {prompt}\nAnswer: {response}\nRate the answer from 0 to 10. Score:",
        description="The judge's prompt, sent as a user message; {prompt}, {response} and {ground_truth} are filled in.",
    )
    score_pattern: str = Field(
        r"(-?\d+(?:\.\d+)?)",
        description="A regex with one group: its first match in the judgement is the score (a float).",
    )
    max_tokens: int = Field(16, ge=1, description="Tokens the judge may write.")
    weight: float = Field(1.0, description="Weight of the judge's score in the summed reward.")
    fail_score: float = Field(0.0, description="Score of a judgement the pattern does not match (counted in reward/judge_unparsed).")
    engine: Literal["auto", "hf", "vllm"] = Field("hf", description="Rollout engine that runs the judge (greedy).")

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        import re

        try:
            groups = re.compile(v).groups
        except re.error as exc:
            raise ValueError(f"reward.judge.score_pattern '{v}' is not a regex ({exc}). Fix: escape it.") from None
        if groups != 1:
            raise ValueError(
                f"reward.judge.score_pattern '{v}' has {groups} groups; it needs exactly one, holding the score. "
                r"Fix: e.g. 'Score: (\d+)' (use (?:...) for other groups)."
            )
        return v

    @field_validator("prompt_template")
    @classmethod
    def _known_fields(cls, v: str) -> str:
        try:
            v.format(prompt="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"reward.judge.prompt_template cannot be filled in ({type(exc).__name__}: {exc}); it may name only "
                "{prompt}, {response} and {ground_truth}. Fix: write other braces doubled, {{ and }}."
            ) from None
        return v


class RewardConfig(Section):
    verifiers: list[VerifierSpec] = Field(
        default_factory=lambda: [VerifierSpec(name="math_17k_acc")],
        min_length=1,
        description="Verifiers and weights (verifier_function / verifier_weight of the guides). They also give the "
        "rule-checked accuracy of validation; weight 0 logs a verifier without rewarding it (an RM-only reward).",
    )
    timeout_s: float = Field(5.0, gt=0, description="Per-call time limit of an answer-equivalence check.")
    workers: int = Field(2, ge=1, description="Worker processes for verification.")
    reward_model: RewardModelConfig | None = Field(
        None, description="A reward model added to the rule verifiers by weight (training rewards only; docs/rewards.md)."
    )
    judge: JudgeConfig | None = Field(
        None, description="An LLM judge (generative RM) added to the rule verifiers by weight (training rewards only)."
    )

    @field_validator("verifiers", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        # Accept the short form `verifiers: [math_17k_acc, format]`.
        if isinstance(v, list):
            return [{"name": x} if isinstance(x, str) else x for x in v]
        return v

    @field_validator("verifiers")
    @classmethod
    def _resolve(cls, v: list[VerifierSpec]) -> list[VerifierSpec]:
        # Resolve names now (built-ins, and users' 'module:function' imported here), so that a typo is
        # reported by check-config with the other problems, not by train after the model has loaded.
        from postrl.rewards.registry import verifier_problems

        problems = verifier_problems([spec.name for spec in v])
        if problems:
            raise ValueError("\n".join(problems))
        return v


# -------------------------------------------------------------------------------------------- train
class TrainConfig(Section):
    global_batch_size: int = Field(32, ge=1, description="Prompts (groups) per training step after filtering.")
    gen_batch_size: int | None = Field(
        None, ge=1, description="Prompts per generation batch (default global_batch_size; larger with filtering)."
    )
    mini_batch_size: int | None = Field(
        None, ge=1, description="Prompts per optimizer step (default global_batch_size: one update per step)."
    )
    micro_batch_size: int = Field(16, ge=1, description="Sequences per forward/backward pass (grad accumulation).")
    use_dynamic_bsz: bool = Field(False, description="Form micro-batches by token budget instead of count.")
    use_remove_padding: bool = Field(
        True,
        description="Pack each micro-batch's sequences into rows without padding (position ids restart per sequence; "
        "flash attention: one row, varlen kernels; sdpa / eager: block-diagonal causal mask). Same log-probs, fewer tokens.",
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="Tokens per fp32 log-softmax chunk: [tokens, vocab] is never held in fp32 at once."
    )
    max_token_len_per_device: int = Field(4096, ge=1, description="Token budget of a micro-batch (dynamic bsz).")
    log_prob_micro_batch_size: int | None = Field(
        None, ge=1, description="Sequences per forward of the old / reference log-prob passes, which keep no activations "
        "for backward and so can be larger (verl's log_prob_micro_batch_size_per_gpu; default micro_batch_size).",
    )
    log_prob_max_token_len: int | None = Field(
        None, ge=1, description="Token budget of a log-prob micro-batch with use_dynamic_bsz (verl's "
        "log_prob_max_token_len_per_gpu; default max_token_len_per_device).",
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size): each micro-batch's tokens are "
        "split across this many ranks, attention exchanges heads by all-to-all, so a 30k-token response fits; "
        "with use_dynamic_bsz a micro-batch holds sequence_parallel_size x max_token_len_per_device tokens, each rank "
        "max_token_len_per_device of them; the ranks of a group train on the same rows, so batches split over "
        "world / sequence_parallel_size data-parallel ranks. Must divide the world size and the model's attention "
        "heads; text and vision-language models, padded or packed rows; not with PPO's critic (docs/gpu.md).",
    )
    epochs_per_batch: int = Field(1, ge=1, description="PPO epochs over each batch.")
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    total_steps: int = Field(100, ge=1, description="Training steps (one batch of global_batch_size groups each).")
    total_epochs: int | None = Field(
        None, ge=1, description="Passes over the training prompts (verl's trainer.total_epochs): when set, it replaces "
        "total_steps with total_epochs x (kept prompts // global_batch_size), counted once the prompts are loaded.",
    )
    seed: int = Field(42, description="Seed of everything random in the run.")
    deterministic: bool = Field(False, description="Deterministic algorithms (the guides' use_deter_comp).")
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="Where this process computes: auto = cuda:LOCAL_RANK / npu:LOCAL_RANK when present, else cpu."
    )
    strategy: Literal["fsdp2", "ddp"] = Field(
        "fsdp2", description="Data parallelism with more than one process: fsdp2 (sharded) or ddp (replicated)."
    )
    reshard_after_forward: bool = Field(
        True,
        description="FSDP2: free each block's gathered parameters after its forward and gather them again for backward "
        "(verl's fsdp_config.reshard_after_forward). False keeps them gathered from forward to backward: one all-gather "
        "fewer per block and step, for the memory of the whole unsharded policy during the update.",
    )
    ref_offload: bool = Field(
        False,
        description="Keep the KL reference model in host memory: FSDP2 copies each block to the device for its "
        "forward; one device or DDP moves it in for the reference pass only. Saves its bf16 weights (2 bytes per "
        "parameter per device, divided by the world size under FSDP2) for a host-to-device copy per step.",
    )
    num_threads: Annotated[int, Field(ge=1)] | Literal["auto", "load"] = Field(
        "auto", description="CPU intra-op threads of each process: a number; auto = its usable cores / the job's "
        "processes on the machine; load = the same, but no more than the cores other processes leave idle (1-minute "
        "load average at start). OMP_NUM_THREADS wins over auto and load. See docs/performance.md.",
    )

    # Field validators (not a model validator) so these run even when another train field is invalid.
    @field_validator("num_threads", mode="before")
    @classmethod
    def _threads_null_is_auto(cls, v: Any) -> Any:
        return "auto" if v is None else v  # null meant the default before auto / load had names

    @field_validator("gen_batch_size")
    @classmethod
    def _gen_at_least_global(cls, v: int | None, info) -> int | None:
        gbs = info.data.get("global_batch_size")
        if v is not None and gbs is not None and v < gbs:
            raise ValueError(
                f"train.gen_batch_size ({v}) is smaller than train.global_batch_size ({gbs}): each generation "
                f"batch must be able to fill a training batch. Fix: set train.gen_batch_size >= {gbs}."
            )
        return v

    @field_validator("mini_batch_size")
    @classmethod
    def _mini_divides_global(cls, v: int | None, info) -> int | None:
        gbs = info.data.get("global_batch_size")
        if v is not None and gbs is not None and (v > gbs or gbs % v):
            raise ValueError(
                f"train.mini_batch_size ({v}) must divide train.global_batch_size ({gbs}) so that every optimizer "
                "step sees whole groups. Fix: choose a divisor of global_batch_size."
            )
        return v

    @model_validator(mode="after")
    def _derive(self) -> "TrainConfig":
        if self.gen_batch_size is None:
            self.gen_batch_size = self.global_batch_size
        if self.mini_batch_size is None:
            self.mini_batch_size = self.global_batch_size
        if self.log_prob_micro_batch_size is None:
            self.log_prob_micro_batch_size = self.micro_batch_size
        if self.log_prob_max_token_len is None:
            self.log_prob_max_token_len = self.max_token_len_per_device
        return self


class _Finetune(Section):
    """The optimizer settings the SFT warm start and `postrl rm` share (defaults: SFT's)."""

    steps: int = Field(1000, ge=1, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Examples (or pairs) per step.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("cosine", description="LR after warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_length: int = Field(256, ge=8, description="Tokens per example; SFT truncates longer ones, rm cuts them from the left.")
    seed: int = Field(0, description="Seed.")


class SFTConfig(_Finetune):
    output_dir: str = Field("runs/sft", description="Where the fine-tuned model is saved (HF format, in model/).")
    eval_prompts: int = Field(200, ge=0, description="Greedy held-out accuracy on this many val prompts at the end.")


# ---------------------------------------------------------------------------------------------- rm
class RMTrainConfig(_Finetune):
    """`postrl rm`: a reward model trained from preference pairs or labelled outcomes (docs/rewards.md)."""

    train_files: list[str] = Field(
        default_factory=lambda: ["builtin:arithmetic_pairs:train"],
        description="Parquet / JSONL with prompt + chosen + rejected (pairs, Bradley-Terry) or prompt + response + "
        "label (pointwise); builtin:arithmetic_pairs:train is the built-in task's pairs (data.builtin's knobs).",
    )
    val_files: list[str] = Field(
        default_factory=lambda: ["builtin:arithmetic_pairs:val"], description="Held-out pairs: pairwise accuracy at the end."
    )
    objective: Literal["auto", "pairwise", "pointwise"] = Field(
        "auto", description="pairwise (-log sigmoid(r_chosen - r_rejected)), pointwise (BCE on label), auto: by the columns."
    )
    output_dir: str = Field("runs/rm", description="Where the reward model is saved (HF format, in model/).")
    steps: int = Field(300, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Pairs (or labelled responses) per step.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    eval_pairs: int = Field(500, ge=0, description="Held-out pairs scored at the end (0: none).")


# ---------------------------------------------------------------------------------------- checkpoint
class CheckpointConfig(Section):
    dir: str | None = Field(None, description="Checkpoint directory (default <logging.dir>/checkpoints).")
    save_freq: int = Field(
        0, ge=-1, description="Save every N steps; 0 = only at the end; -1 = never (as verl's trainer.save_freq=-1: "
        "no checkpoint at all, so the run cannot be resumed).",
    )
    save_final: bool = Field(True, description="Save a checkpoint after the last step.")
    resume: str = Field("auto", description="auto (latest in dir, if any) | none | <checkpoint path>.")
    finetune: bool = Field(False, description="Load weights only; start a fresh run from them.")
    load_optimizer: bool = Field(True, description="Restore optimizer and scheduler state on resume.")
    load_rng: bool = Field(True, description="Restore RNG states on resume.")
    ref_model_path: str | None = Field(None, description="Weights of the reference model (default model.path).")
    keep_last: int = Field(2, ge=0, description="Keep the newest N checkpoints; 0 keeps all.")
    keep_best: str | None = Field(
        None,
        description="A validation metric to maximise, e.g. val/arithmetic/acc_mean@1 (or val/*/acc_mean@1: the first "
        "validation set's): the weights of its best validation (the start included) are kept in "
        "<checkpoint.dir>/best (export with `postrl export DIR/best OUT`).",
    )
    back_off: float | None = Field(
        None,
        gt=0,
        le=1,
        description="With keep_best (without it, off): when a validation falls more than this below the best one "
        "(0.02 = 2 points), go back to the best weights, multiply the learning rate by back_off_lr_factor and say so; "
        "a fall at the last validation ends the run with the best weights (docs/learning.md). None: off.",
    )
    back_off_lr_factor: float = Field(0.5, gt=0, le=1, description="The learning rate's factor at each back-off.")
    end_with_best: float | None = Field(
        None,
        ge=0,
        le=1,
        description="With keep_best (without it, off): when the last validation is more than this below the best one "
        "(0.01 = 1 point), the run ends with the best weights (the final checkpoint holds them) and says so; the "
        "validations stay logged as measured. None: back_off's value (or off).",
    )

    @field_validator("keep_best")
    @classmethod
    def _validation_metric(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("val/"):
            raise ValueError(
                f"checkpoint.keep_best is '{v}', not a validation metric. Fix: name one of the val/<set>/... metrics, "
                "e.g. val/arithmetic/acc_mean@1 (<set> is the validation file's stem)."
            )
        return v


class EvalConfig(Section):
    files: list[str] | None = Field(None, description="Validation files (default data.val_files).")
    freq: int = Field(0, ge=0, description="Validate every N steps; 0 = only before/after training.")
    before_train: bool = Field(True, description="Validate before the first step.")
    after_train: bool = Field(True, description="Validate after the last step.")
    n_samples: int = Field(1, ge=1, description="Samples per prompt (1 with temperature 0 = greedy accuracy).")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    max_prompts: int = Field(500, ge=1, description="Evaluate on at most this many prompts per file.")
    max_tokens: int | None = Field(None, ge=1, description="Default rollout.max_tokens.")


class GuardsConfig(Section):
    """Correctness checks, on by default (src/postrl/guards.py, docs/algorithms.md#guards)."""

    enable: bool = Field(True, description="Run the guards; each says what it found as a warning or an error.")
    first_ratio_tol: float | None = Field(
        None, gt=0, description="|logp - logp_old| before the first optimizer step: largest (float32, default 1e-3) or mean (bf16/fp16, default 5e-2)."
    )
    sync_tol: float | None = Field(
        None, gt=0, description="Engine-vs-trainer log-prob gap on the probe after a sync: largest (float32, default 1e-3) or mean (bf16/fp16, default 5e-2)."
    )
    drift_limit: float = Field(0.1, gt=0, description="Warn when rollout/logprob_diff_mean exceeds this.")
    entropy_floor: float = Field(0.01, ge=0, description="Warn when actor/entropy stays below this ...")
    entropy_steps: int = Field(5, ge=1, description="... for this many steps in a row.")
    no_signal_steps: int = Field(5, ge=1, description="Warn when every group has zero reward spread this many steps in a row.")
    slow_reward_share: float = Field(0.1, ge=0, le=1, description="Warn when more than this share of reward calls time out.")


class LoggingConfig(Section):
    sinks: list[Literal["console", "jsonl", "tensorboard", "wandb", "swanlab"]] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="Where metrics go; tensorboard, wandb and swanlab need their extra "
        "(pip install 'postrl[tensorboard]').",
    )
    dir: str = Field("runs/default", description="Run directory: metrics.jsonl, plots, checkpoints.")
    log_interval: int = Field(1, ge=1, description="Print a step line every N steps.")
    progress: bool = Field(True, description="Show a rich progress bar.")
    verbose: bool = Field(
        False, description="Show third-party warnings and logs (transformers, vLLM, torch, Python warnings) and "
        "Hugging Face progress bars on the terminal; by default they go to <logging.dir>/postrl.log (postrl.console).",
    )
    metric_names: Literal["postrl", "mindspeed", "verl"] = Field(
        "postrl",
        description="Names the sinks write: postrl (docs/metrics.md), mindspeed (MindSpeed-RL / -MM dashboards: grad_norm, "
        "dapo/lr, timing/non_overlap_*) or verl (timing_s/*, critic/score/*, perf/*). Every name and its formula: "
        "docs/metrics.md. The console line keeps postrl's names.",
    )

    def missing_packages(self) -> list[str]:
        """One problem per sink whose optional package is not installed on this machine."""
        # find_spec, not import: wandb / swanlab take seconds to import and start threads.
        # Each optional sink's package and the pip extra that installs it carry the sink's name.
        return [
            f"logging.sinks: the '{sink}' sink needs the {sink} package, which is not installed here; the run "
            f"would stop with ModuleNotFoundError after loading the model. Fix: pip install 'postrl[{sink}]', "
            f"or remove {sink} from logging.sinks."
            for sink in dict.fromkeys(self.sinks)
            if sink in ("tensorboard", "wandb", "swanlab") and importlib.util.find_spec(sink) is None
        ]


class ClusterConfig(Section):
    launcher: Literal["local", "torchrun", "ray"] = Field("local", description="How processes are started.")
    nnodes: int = Field(1, ge=1, description="Nodes (NNODES).")
    devices_per_node: int = Field(1, ge=1, description="Processes per node (NPUS_PER_NODE / GPUs).")
    ray_address: str | None = Field(None, description="Ray cluster address (ray start --head ...).")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="How long a collective (all-reduce, all-gather, barrier) may wait for the other ranks "
        "before the run fails with a timeout: the process group's timeout for nccl, hccl and gloo alike (the role of "
        "the guides' HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT). Raise it when one rank can lag far behind (long "
        "rollouts, slow verifiers, checkpoint writes to slow storage).",
    )


class CriticConfig(Section):
    """The value model of PPO (algorithm.adv_estimator: gae); ignored by the critic-free estimators."""

    model_path: str | None = Field(
        None,
        description="A token-classification model with one label (a critic saved by postrl: <checkpoint>/critic/model). "
        "Default: the policy's initial weights with a fresh value head.",
    )
    lr: float = Field(1e-5, gt=0, description="Critic learning rate (AdamW; betas, weight decay and grad clip: train's).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup of the critic's learning rate, then constant.")
    cliprange_value: float = Field(0.5, gt=0, description="Value clipping: V stays within V_old +- this in the loss.")


class Config(Section):
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rm: RMTrainConfig = Field(default_factory=RMTrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _derive(self) -> "Config":
        self.algorithm._derive()
        if self.checkpoint.save_freq < 0:  # never: no periodic and no final checkpoint
            self.checkpoint.save_freq, self.checkpoint.save_final = 0, False
        if self.checkpoint.dir is None:
            self.checkpoint.dir = str(Path(self.logging.dir) / "checkpoints")
        if self.eval.files is None:
            self.eval.files = list(self.data.val_files)
        if self.eval.max_tokens is None:
            self.eval.max_tokens = self.rollout.max_tokens
        problems = []
        ob = self.algorithm.overlong_buffer
        if ob.enable and ob.len >= self.rollout.max_tokens:
            problems.append(
                f"algorithm.overlong_buffer.len ({ob.len}) must be smaller than rollout.max_tokens "
                f"({self.rollout.max_tokens}): the penalty starts at max_tokens - len. "
                "Fix: shorten the buffer or raise rollout.max_tokens."
            )
        ep, tp = self.rollout.expert_parallel_size, self.rollout.tensor_parallel_size
        if ep > 1 and ep != tp:
            problems.append(
                f"rollout.expert_parallel_size ({ep}) must equal rollout.tensor_parallel_size ({tp}): vLLM's expert-parallel "
                "group is the engine's tensor-parallel ranks (tensor x data parallel within one engine; postrl's colocated "
                f"engines are one tensor-parallel group each). Fix: set rollout.expert_parallel_size: {tp}, or 1."
            )
        sp = self.train.sequence_parallel_size
        if sp > 1 and self.world_size > 1 and self.world_size % sp:  # else the launch decides the world (--nproc)
            problems.append(
                f"train.sequence_parallel_size ({sp}) must divide the world size ({self.world_size} devices): each "
                "sequence-parallel group is that many ranks. Fix: choose a divisor, or change cluster.devices_per_node / nnodes."
            )
        rc = self.algorithm.rollout_correction
        if self.rollout.mode == "async" and self.rollout.max_staleness > 0 and "enable" not in rc.model_fields_set:
            rc.enable = True  # the decoupled objective (AReaL): stale samples weighted by trainer / engine, truncated
        if sp > 1 and _needs_critic(self.algorithm.adv_estimator):
            problems.append(
                f"train.sequence_parallel_size ({sp}) with adv_estimator '{self.algorithm.adv_estimator}': the critic's "
                "value passes and update do not split sequences yet (only the actor's do). Fix: set "
                "train.sequence_parallel_size: 1 for PPO, or use a critic-free estimator (grpo, rloo, ...)."
            )
        a = self.algorithm
        if a.use_kl_in_reward and not _needs_critic(a.adv_estimator):
            problems.append(
                f"algorithm.use_kl_in_reward puts a KL penalty on every token's reward, which only a per-token estimator "
                f"with a critic uses; adv_estimator '{a.adv_estimator}' reads one reward per sequence. Fix: set "
                "algorithm.adv_estimator: gae, or use the KL loss (algorithm.kl.coef) instead."
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def world_size(self) -> int:
        return self.cluster.nnodes * self.cluster.devices_per_node


def _needs_critic(adv_estimator: str) -> bool:
    from postrl import algorithms

    return algorithms.needs_critic(adv_estimator)


# ------------------------------------------------------------------------------------------ loading
def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`a.b=1` pairs; values are parsed as YAML (so 0.3 is a float, [a,b] a list, null None)."""
    out, bad = [], []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            bad.append(
                f"override '{item}' is not of the form section.key=value. "
                "Fix: write it like algorithm.clip_ratio_high=0.3."
            )
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    if bad:
        raise UserError(*bad, title="bad command-line overrides")
    return out


def _describe_error(err: dict, cfg_cls: type[BaseModel]) -> list[str]:
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        section_cls = _section_at(cfg_cls, err["loc"][:-1])
        valid = sorted(section_cls.model_fields) if section_cls else []
        key = str(err["loc"][-1])
        guess = difflib.get_close_matches(key, valid, n=1)
        hint = f" Did you mean '{guess[0]}'?" if guess else ""
        where = ".".join(str(p) for p in err["loc"][:-1]) or "the top level"
        return [
            f"{loc}: unknown key '{key}' in {where}; a misspelt key would be silently ignored, so it is refused."
            f"{hint} Valid keys: {', '.join(valid)}."
        ]
    if kind == "missing":
        return [f"{loc}: required but missing. Fix: set {loc} in the YAML or as {loc}=... on the command line."]
    if kind in ("value_error", "assertion_error"):
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        prefix = f"{loc}: " if loc else ""
        return [prefix + line for line in msg.split("\n") if line]
    got = err.get("input")
    got_s = repr(got) if not isinstance(got, dict) else "a mapping"
    field = _field_at(cfg_cls, err["loc"])
    why = f" {field.description.rstrip('.')}." if field is not None and field.description else ""
    return [f"{loc}: {err['msg'].rstrip('.')} (got {got_s}).{why} Fix: set {loc} to a valid value."]


def _field_at(cls: type[BaseModel], loc: tuple):
    section = _section_at(cls, loc[:-1])
    return section.model_fields.get(str(loc[-1])) if section is not None and loc else None


def _section_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return None
    return cls


def build_config(tree: dict, source: str = "config") -> Config:
    """Validate a config tree; raise a UserError that lists every problem."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            problems.extend(_describe_error(err, Config))
        raise UserError(*problems, title=f"{source}: {len(problems)} problem(s) in the configuration") from None


def read_yaml_mapping(path: str | Path, example: str, keys: str) -> dict:
    """The mapping at the top of a YAML file; a missing file, bad YAML or a non-mapping is a UserError."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file '{path}' does not exist. Fix: pass the path of a YAML file, e.g. {example}.")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    if not isinstance(tree, dict):
        raise UserError(f"{path} must hold a mapping of {keys}, not {type(tree).__name__}.")
    return tree


def _is_config_key(dotted: str) -> bool:
    loc = tuple(dotted.split("."))
    return _section_at(Config, loc[:-1]) is not None and loc[-1] in _section_at(Config, loc[:-1]).model_fields


def _split_guides_overrides(overrides: list[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """verl-style overrides (`actor_rollout_ref.rollout.n=8`, `data.train_batch_size=4`) translated through
    postrl.guides' table, and the postrl overrides left as they are. A verl key with no postrl counterpart
    is reported as a warning with what postrl offers instead, so a guide's command line still runs."""
    from postrl.guides import convert_verl, split_overrides

    verl, native = split_overrides(overrides, _is_config_key)
    if not verl:
        return [], native
    conv = convert_verl(verl)
    for u in conv.unmapped:
        logging.getLogger("postrl.config").warning("override %s=%r not applied: %s", u.source, u.value, u.instead)
    return list(conv.flat().items()), native


def load_config(path: str | Path | None, overrides: list[str] | None = None, check_paths: bool = True) -> Config:
    """Load a YAML file, apply dotted overrides, validate; optionally check this machine
    (`environment_problems`: input paths exist, the logging sinks' packages are installed)."""
    tree: dict = {}
    source = str(path) if path else "command line"
    if path is not None:
        tree = read_yaml_mapping(path, example="configs/tiny_dapo.yaml", keys="sections (model:, data:, ...)")
    verl, native = _split_guides_overrides(overrides or [])
    for key, value in verl:
        _set_dotted(tree, key, value)
    for key, value in parse_overrides(native):
        _set_dotted(tree, key, value)
    cfg = build_config(tree, source)
    if check_paths:
        problems = environment_problems(cfg)
        if problems:
            raise UserError(*problems, title=f"{source}: {len(problems)} problem(s) in the configuration")
    return cfg


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "/", "~"))


def path_problems(cfg: Config) -> list[str]:
    """Input files and model paths that do not exist (checked before anything starts)."""
    problems = []
    mp = cfg.model.path
    if not mp.startswith("builtin:") and not Path(mp).expanduser().exists() and not _looks_like_hub_id(mp):
        problems.append(
            f"model.path: '{mp}' does not exist. The policy is loaded from a Hugging Face model directory. "
            "Fix: point model.path at a directory with config.json (for the tiny default, run "
            "`postrl sft configs/tiny_sft.yaml` first, as `make run` does), or use 'builtin:tiny-qwen2'."
        )
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for f in files:
            if not f.startswith("builtin:") and not Path(f).expanduser().exists():
                problems.append(f"{key}: file '{f}' does not exist. Fix: run `postrl preprocess` or correct the path.")
    return problems


def environment_problems(cfg: Config) -> list[str]:
    """What this machine lacks for the run: missing input paths, uninstalled sink packages."""
    return path_problems(cfg) + cfg.logging.missing_packages()


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
