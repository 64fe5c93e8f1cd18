"""Run configuration, the schema: pydantic models of every section, each field documented, each checked alone.

Names follow the MindSpeed-RL / verl guides so users can carry their settings over. Every field has
a docstring-like `description`. Values left as None are derived in one place, right after parsing, by the
cross-section rules (rules.py, called from `Config._derive`): `algorithm.name: dapo` switches on DAPO's
defaults (clip-higher 0.28, token-mean, overlong buffer, filter_groups, no KL), and every DAPO piece also
works alone under GRPO. YAML loading, overrides and error reports are loading.py's; the built-in tasks'
knobs are knobs.py's.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from postrl.config.knobs import BuiltinTaskConfig, ShapesTaskConfig, ToolArithmeticConfig
from postrl.config.rules import derive
from postrl.sandbox_limits import DEFAULT as SANDBOX
from postrl.utils import is_loopback



def env_names(names: list[str]) -> list[str]:
    """`names` when each is an environment variable's name (letters, digits, underscores, not starting with a digit)."""
    from postrl.children import ENV_NAME

    bad = [n for n in names if not ENV_NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"lists {bad[:3]}, which {'are' if len(bad) > 1 else 'is'} not the name of an environment "
                         "variable: it names variables to pass to child processes. Fix: list names such as OPENAI_API_KEY.")
    return names


# The *env_passthrough keys: names of environment variables handed to child processes beside the allowlist.
EnvNames = Annotated[list[str], AfterValidator(env_names)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, protected_namespaces=())


# --------------------------------------------------------------------------------------------- model
class ModelConfig(Section):
    path: str = Field(
        description="Hugging Face model directory or hub id (e.g. Qwen/Qwen2.5-7B-Instruct, "
        "Qwen/Qwen2.5-VL-7B-Instruct), or 'builtin:tiny-qwen2' / 'builtin:tiny-qwen2.5-vl' for the built-in "
        "tiny text / vision-language model (built locally and cached), 'builtin:tiny-qwen3-moe' for a tiny "
        "mixture-of-experts model, 'builtin:smollm2-135m-instruct' for a small pretrained instruct model (the `real` "
        "extra), or a .gguf file (dequantized once into a cached model directory)."
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
    # rollout.environment's settings (rules.derive), for the data files 'verifiers:train' / 'verifiers:eval'
    _environment: dict | None = PrivateAttr(None)

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # verl writes data.train_files=$HOME/data/train.parquet
    shapes: ShapesTaskConfig = Field(default_factory=ShapesTaskConfig, description="Built-in visual task knobs.")
    tool_arithmetic: ToolArithmeticConfig = Field(
        default_factory=ToolArithmeticConfig, description="Knobs of the built-in task where tools matter."
    )


# ------------------------------------------------------------------------------------------- rollout
class SandboxConfig(Section):
    """Where and under which limits builtin:python runs model-written code (docs/agents.md, "Tools and the sandbox").
    Its time limit is rollout.multi_turn.tool_timeout_s; the defaults are postrl/sandbox_limits.py's, which the
    backends read."""

    backend: Literal["local", "sandbox_fusion"] = Field(
        SANDBOX.backend, description="local: a fenced process tree on this machine (namespaces); sandbox_fusion: POST "
        "the code to a SandboxFusion service at `url` (for clusters where namespaces are refused).",
    )  # fmt: skip
    url: str | None = Field(SANDBOX.url, description="sandbox_fusion: the service's base URL, e.g. http://sandbox:8080.")
    require_isolation: bool = Field(
        SANDBOX.require_isolation, description="local: refuse to run code where network, file-system and PID isolation "
        "is unavailable. false runs it with rlimits only (never as root), with a warning at every run.",
    )  # fmt: skip
    memory_mb: int = Field(SANDBOX.memory_mb, ge=16,
                           description="Address-space limit of the code (sandbox_fusion: memory_limit_MB).")
    cpu_s: int | None = Field(SANDBOX.cpu_s, ge=1,
                              description="local: CPU-time limit; default the tool's time limit rounded up + 1 s.")
    max_processes: int = Field(SANDBOX.max_processes, ge=1, description="local: processes and threads the code may start.")
    max_file_mb: int = Field(SANDBOX.max_file_mb, ge=0, description="local: largest file the code may write.")
    max_open_files: int = Field(SANDBOX.max_open_files, ge=8, description="local: open file descriptors of the code.")
    max_output_bytes: int = Field(SANDBOX.max_output_bytes, ge=1,
                                  description="stdout and stderr kept per call, each; past it the run is cut.")
    tmpfs_mb: int = Field(SANDBOX.tmpfs_mb, ge=1,
                          description="local: size of each private scratch space (/tmp, the working directory).")
    concurrency: int = Field(SANDBOX.concurrency, ge=1,
                             description="sandbox_fusion: requests in flight at once from this process.")
    retries: int = Field(SANDBOX.retries, ge=0, description="sandbox_fusion: retries of a connection that could not be "
                         "made (a request that reached the service is never sent again: its code may have run).")
    retry_after_max_s: float = Field(SANDBOX.retry_after_max_s, ge=0, description="sandbox_fusion: the longest a 429/503 "
                                     "answer's Retry-After holds back the next requests.")
    max_reply_bytes: int = Field(SANDBOX.max_reply_bytes, ge=1024, description="sandbox_fusion: the longest reply read; "
                                 "past it the call is output_limit.")
    connect_timeout_s: float = Field(SANDBOX.connect_timeout_s, gt=0,
                                     description="sandbox_fusion: time limit to connect to the service.")
    request_slack_s: float = Field(
        SANDBOX.request_slack_s, ge=0,
        description="sandbox_fusion: time allowed beyond the run's own limit for queueing and transfer.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _needs_url(self) -> "SandboxConfig":
        if self.backend == "sandbox_fusion" and not self.url:
            raise ValueError(
                "backend sandbox_fusion sends the code to a SandboxFusion service, and no url names it. "
                "Fix: set rollout.multi_turn.sandbox.url, e.g. http://sandbox-host:8080 (docs/agents.md)."
            )
        return self


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
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="builtin:python's backend and limits.")
    interaction: str | None = Field(
        None,
        description="Environment 'package.module:Class' with reset(row) and step(assistant_text) -> (observation, "
        "reward, done); its observations are appended as user turns and its rewards add to the verifier score.",
    )


class PoolConfig(Section):
    replicas: int = Field(2, ge=1, description="Rollout replicas (Ray actors), each holding one engine.")
    devices_per_replica: int = Field(
        0, ge=0, description="Accelerators each replica holds (Ray's GPU / NPU resource); 0 on CPU."
    )
    cpus_per_replica: int = Field(1, ge=1, description="CPU cores each replica holds (its torch threads on CPU).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each replica's bundle asks for (to pin replicas to nodes)."
    )
    max_restarts: int | None = Field(
        None, ge=0, description="Restarts per replica before it is dropped (the run goes on with the rest); default "
        "rollout.max_worker_restarts.",
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
    environment: str | None = Field(
        None, description="A verifiers environment as the rollout: 'verifiers:<module or installed package>' (a Hub "
        "environment) or 'verifiers:path/to/env.py', whose load_environment(**rollout.environment_args) gives the "
        "dataset, the multi-turn logic and the rubric; it runs in its own process against postrl's endpoint and its "
        "rubric's score is the reward (docs/agents.md). The rollout.agent_* settings apply.",
    )
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="rollout.environment: keyword arguments of its load_environment."
    )
    environment_python: str | None = Field(
        None, description="rollout.environment: the interpreter it runs in (e.g. a venv's bin/python with verifiers "
        "0.1.x); default: this one, when it imports verifiers.",
    )
    agent_concurrency: int = Field(64, ge=1, description="rollout.agent: programs running at once.")
    agent_timeout_s: float = Field(300.0, gt=0, description="rollout.agent: time limit per sample; a program past it scores 0.")
    agent_workers: int = Field(
        0, ge=0,
        description="rollout.agent: 0 runs the programs in the trainer's process; N >= 1 runs them in N worker processes, so their "
        "own CPU (the openai client, tools) does not share the trainer's GIL, and a stuck or crashing program is contained.",
    )  # fmt: skip
    agent_env_passthrough: EnvNames = Field(
        default_factory=list, description="rollout.agent / rollout.environment: environment variables the worker and "
        "environment processes (and the rollout worker or pool replicas that start them) get beside the allowlist (PATH, "
        "locale, TZ, TMPDIR, PYTHON*, thread and device settings, the HF cache paths; HOME is an empty directory), e.g. "
        "[OPENAI_API_KEY] for a program that calls another service; the rest of the trainer's (HF_TOKEN, WANDB_API_KEY, "
        "cloud keys) stays behind (children.py, docs/agents.md).",
    )
    agent_batch_wait_ms: float = Field(
        20.0, ge=0, description="rollout.agent: the endpoint samples the requests it holds once every running program "
        "waits on one, or when none arrived for this long (at most 10x this after the first).",
    )
    agent_host: str = Field("127.0.0.1", description="rollout.agent: the endpoint's address (loopback unless set).")
    agent_port: int = Field(0, ge=0, le=65535, description="rollout.agent: the endpoint's port (0: a free one).")
    agent_allow_remote: bool = Field(
        False, description="rollout.agent: let agent_host be an address other machines can reach (the endpoint has no "
        "authentication beyond its session keys); a warning is printed at every start.",
    )
    agent_max_body_bytes: int = Field(
        8 * 2**20, ge=1024, description="rollout.agent: the largest request body; checked from Content-Length before reading.",
    )
    agent_max_json_depth: int = Field(64, ge=4, description="rollout.agent: the deepest nesting of a request body's JSON.")
    agent_max_stop: int = Field(16, ge=1, description="rollout.agent: the most `stop` strings one request may send.")
    agent_max_stop_chars: int = Field(256, ge=1, description="rollout.agent: the longest `stop` string.")
    agent_max_connections: int = Field(
        1024, ge=1, description="rollout.agent: open HTTP connections at once; one more is answered 503 and closed.",
    )
    agent_header_timeout_s: float = Field(
        30.0, gt=0, description="rollout.agent: a connection must complete a request's headers within this (from its "
        "first byte); else it is closed.",
    )
    agent_body_timeout_s: float = Field(60.0, gt=0, description="rollout.agent: a request's body must arrive within this.")
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="Deprecated alias of rollout.placement (sync = colocated, async = worker); set by the placement, and "
        "a run that sets it is told to use rollout.placement instead (docs/async.md).",
    )
    max_staleness: int = Field(
        0, ge=0, le=100, description="Async rollout: the oldest policy version a trained sequence may come from, in updates "
        "behind the trainer (async/staleness_max): 0 on-policy (async reproduces sync), 1 one-step-off, k bounded. "
        "Sync mode is always 0. At most 100: the queue between worker and trainer holds up to k + 1 batches, and a "
        "sample 100 updates old carries little of the current policy.",
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

    placement: Literal["colocated", "worker", "pool"] | None = Field(
        None, description="Where rollout runs (docs/async.md): colocated (the trainer's own engine, in lock-step; the "
        "default), worker (one worker process beside rank 0, asynchronous) or pool (rollout.pool's replicas, Ray "
        "actors on their own cores / devices on any node, weights by broadcast, asynchronous). Unset: from the "
        "deprecated rollout.mode (sync -> colocated, async -> worker).",
    )
    pool: PoolConfig = Field(default_factory=lambda: PoolConfig(), description="rollout.placement pool: the replicas.")

    @property
    def takes_rows(self) -> bool:
        """The engine is an agent wrapper (postrl's agent loop, or the endpoint that runs rollout.agent) whose
        generate also takes the prompts' dataset rows."""
        return self.multi_turn.enable or bool(self.agent) or bool(self.environment)

    @model_validator(mode="after")
    def _async_keys(self) -> "RolloutConfig":
        if self.placement is None:
            self.placement = "colocated" if self.mode == "sync" else "worker"
        elif self.placement == "colocated" and self.mode == "async":
            raise ValueError(
                "rollout.placement is colocated (the trainer's own engine, in lock-step) but rollout.mode is async. "
                "Fix: set rollout.placement: worker or pool for asynchronous rollout, or rollout.mode: sync."
            )
        elif self.placement != "colocated" and self.mode == "sync" and "mode" in self.model_fields_set:
            raise ValueError(
                f"rollout.placement is {self.placement} (rollout apart from the trainer, asynchronous) but rollout.mode "
                "is sync. Fix: drop rollout.mode (the placement sets it), or use rollout.placement: colocated."
            )
        else:
            user_set = "mode" in self.model_fields_set
            self.mode = "sync" if self.placement == "colocated" else "async"
            if not user_set:  # derived from the placement: not the user's (config_notes names a mode the user set)
                self.__pydantic_fields_set__.discard("mode")
        if self.mode == "sync" and self.max_staleness != 0:
            raise ValueError(
                f"rollout.max_staleness is {self.max_staleness}, but synchronous rollout always trains on the current "
                "policy's samples (staleness 0). Fix: set rollout.placement: worker or pool to let rollout run ahead, or leave "
                "rollout.max_staleness at 0."
            )
        if self.partial_rollout and self.mode == "sync":
            raise ValueError(
                "rollout.partial_rollout continues generations across weight updates, which only happen mid-generation "
                "in async mode. Fix: set rollout.placement: worker or pool, or rollout.partial_rollout: false."
            )
        mt = self.multi_turn
        if mt.enable and not mt.tools and not mt.interaction:
            raise ValueError(
                "rollout.multi_turn.enable is true, but neither rollout.multi_turn.tools nor rollout.multi_turn.interaction "
                "is set: the agent loop would have nothing to call or talk to, and run as single-turn rollout. Fix: list "
                "the tools (e.g. [builtin:calculator]) or name an environment, or set rollout.multi_turn.enable: false."
            )
        if (self.agent or self.environment) and not self.agent_allow_remote and not is_loopback(self.agent_host):
            raise ValueError(
                f"rollout.agent_host is {self.agent_host}, an address other machines can reach, but the endpoint trusts "
                "whoever knows a session key and samples with the policy being trained. Fix: leave rollout.agent_host at "
                "127.0.0.1, or set rollout.agent_allow_remote: true to serve on it anyway (a warning at every start)."
            )
        if self.agent_max_connections < self.agent_concurrency:
            raise ValueError(
                f"rollout.agent_max_connections ({self.agent_max_connections}) is below rollout.agent_concurrency "
                f"({self.agent_concurrency}): running programs would be refused connections. Fix: raise "
                "rollout.agent_max_connections or lower rollout.agent_concurrency."
            )
        if self.agent and self.multi_turn.enable:
            raise ValueError(
                "rollout.agent and rollout.multi_turn.enable both say how to roll out: the user's program through the "
                "endpoint, or postrl's own agent loop. Fix: keep one (the program calls its own tools)."
            )
        if self.environment is not None:
            name = self.environment.removeprefix("verifiers:").strip()
            if not self.environment.startswith("verifiers:") or not name:
                raise ValueError(
                    f"rollout.environment '{self.environment}' is not of the form 'verifiers:<module or package>' (or "
                    "'verifiers:path/to/env.py'): postrl runs verifiers environments. Fix: write e.g. "
                    "'verifiers:wordle' (an installed Hub environment) or 'verifiers:my_env.py'."
                )
            if self.agent or self.multi_turn.enable:
                other, loop = ("rollout.agent", "your program") if self.agent else ("rollout.multi_turn.enable", "postrl's agent loop")
                raise ValueError(
                    f"rollout.environment and {other} both say how to roll out: the verifiers environment's own loop, or "
                    f"{loop}. Fix: keep one (the environment runs its own tools)."
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
    metric: str = Field(
        "acc",
        description="Raw verifier metric whose zero-std groups are dropped: acc, score, seq_reward, or a verifier's name "
        "(its score). The guides' names are accepted: MindSpeed-RL's <algo>/<verifier>_rewards/mean (the verifier's "
        "score) and verl's seq_final_reward (= seq_reward).",
    )
    max_num_gen_batches: int = Field(
        10, description="Give up after this many generation batches per step; <= 0 means no limit."
    )

    @field_validator("metric")
    @classmethod
    def _guides_names(cls, v: str) -> str:
        m = re.fullmatch(r"[A-Za-z_]+/(?P<verifier>.+)_rewards/mean", v)
        return m["verifier"] if m else {"seq_final_reward": "seq_reward"}.get(v, v)




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


# ------------------------------------------------------------------------------------------- reward
class VerifierSpec(Section):
    name: str = Field(description="Registered verifier name or 'package.module:function'.")
    weight: float = Field(1.0, description="Weight in the summed reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments the verifier is called with (verl's custom_reward_function.reward_kwargs); "
        "the function must take them by name (or **kwargs).",
    )


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


# The validation context's key for the verifier-name resolver, a function of [(name, kwargs)] -> problems
# (postrl.rewards.registry.verifier_problems); without it names are checked when the rewards are built.
VERIFIER_CHECK = "verifier_problems"


class RewardConfig(Section):
    verifiers: list[VerifierSpec] = Field(
        default_factory=lambda: [VerifierSpec(name="math_17k_acc")],
        min_length=1,
        description="Verifiers and weights (verifier_function / verifier_weight of the guides). They also give the "
        "rule-checked accuracy of validation; weight 0 logs a verifier without rewarding it (an RM-only reward).",
    )
    timeout_s: float = Field(5.0, gt=0, description="Per-call time limit of an answer-equivalence check.")
    workers: int = Field(2, ge=1, description="Worker processes for verification.")
    env_passthrough: EnvNames = Field(
        default_factory=list, description="Environment variables the verifier worker processes (and the rollout worker or "
        "pool replicas that start them) get beside the allowlist (children.py; HOME is an empty directory), e.g. "
        "[OPENAI_API_KEY] for a verifier that calls a service; the rest of the trainer's (HF_TOKEN, WANDB_API_KEY, cloud "
        "keys) stays behind.",
    )
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
    def _resolve(cls, v: list[VerifierSpec], info: ValidationInfo) -> list[VerifierSpec]:
        # Resolve names now (built-ins, and users' 'module:function' imported here), so that a typo is
        # reported by check-config with the other problems, not by train after the model has loaded. The
        # resolver is the rewards registry's, handed down by the caller (VERIFIER_CHECK in the validation
        # context: postrl.checks.load_config, `postrl verify`): the config stands below the rewards.
        check = (info.context or {}).get(VERIFIER_CHECK)
        problems = check([(spec.name, spec.kwargs) for spec in v]) if check else []
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
    max_nonfinite_steps: int = Field(
        3, ge=0, description="Stop the run after this many training steps in a row with a non-finite loss, log-prob or "
        "gradient (each is skipped, and its rows and layers written to <logging.dir>/nonfinite/step_N.jsonl: "
        "docs/debugging.md); 0 = never stop.",
    )
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
    overwrite: bool = Field(
        False, description="Replace a reward model already in output_dir; false: such a run is refused before it starts."
    )
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
    seq_entropy_floor: float = Field(
        0.5, ge=0, description="... or when actor/entropy x response_length/mean (the answer's entropy, nats) stays below this "
        "(e^0.5 = 1.6 distinct answers per group). Not lower-bounded by health: `make run` ends at 0.7-0.9 nats per answer "
        "with its held-out accuracy at its best (docs/learning.md). 0 = off.",
    )
    entropy_steps: int = Field(5, ge=1, description="... for this many steps in a row.")
    collapse_drop: float = Field(
        0.1, ge=0, le=1, description="heldout_collapse: warn when the headline validation metric falls more than this "
        "(absolute; or collapse_share of the best, whichever is smaller) below its best while the training reward holds; "
        "with checkpoint.back_off also go back to the best weights. 0 = off.",
    )
    collapse_share: float = Field(0.25, gt=0, le=1, description="heldout_collapse: ... or more than this share of the best.")
    collapse_window: int = Field(5, ge=1, description="heldout_collapse: training steps whose mean reward is compared.")
    collapse_reward_tol: float = Field(
        0.02, ge=0, description="heldout_collapse: the reward 'holds' when its recent mean is at least the mean at the best less this."
    )
    no_signal_steps: int = Field(5, ge=1, description="Warn when every group has zero reward spread this many steps in a row.")
    slow_reward_share: float = Field(0.1, ge=0, le=1, description="Warn when more than this share of reward calls time out.")


class SamplesConfig(Section):
    """Samples written as JSONL under <logging.dir>/samples/ (src/postrl/samples.py): prompt, every turn with its tool
    calls and results, response, reward, acc, version, step."""

    rollout_freq: int = Field(
        0, ge=0, description="Write the batch trained on to rollout_step_N.jsonl every N steps (verl: trainer.rollout_data_dir); 0 = off."
    )
    val: bool = Field(True, description="Write every validation's generations to val_step_N.jsonl (verl: trainer.validation_data_dir).")
    print_val: int = Field(
        0, ge=0, description="Print this many generations of each validation set as a table on the console (verl: trainer.log_val_generations)."
    )


class LoggingConfig(Section):
    sinks: list[Literal["console", "jsonl", "tensorboard", "wandb", "swanlab"]] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="Where metrics go; tensorboard, wandb and swanlab need their extra "
        "(pip install 'postrl[tensorboard]').",
    )
    dir: str = Field("runs/default", description="Run directory: metrics.jsonl, plots, checkpoints.")
    log_interval: int = Field(1, ge=1, description="Print a step line every N steps.")
    samples: SamplesConfig = Field(default_factory=SamplesConfig)
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


class DistillConfig(Section):
    """On-policy distillation (docs/algorithms.md#on-policy-distillation): off while teacher_path is unset."""

    teacher_path: str | None = Field(
        None,
        description="The teacher: any Hugging Face causal LM or Qwen-VL directory (or hub id) with the student's "
        "tokenizer; it scores the student's sampled tokens. Held where the KL reference is (train.ref_offload applies).",
    )
    reward_weight: float = Field(
        0.0, ge=0, description="w in A_t + w x A_group: the task reward's share beside the teacher's signal (0: pure distillation)."
    )
    top_k: int = Field(
        0, ge=0, description="0: the sampled-token reverse KL as a per-token advantage; k > 0: the exact reverse KL over the "
        "teacher's top-k tokens at every position, both distributions renormalised over them, added as a loss.",
    )

    @property
    def enable(self) -> bool:
        return self.teacher_path is not None


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
    distill: DistillConfig = Field(default_factory=DistillConfig)

    @model_validator(mode="after")
    def _derive(self) -> "Config":
        return derive(self)  # the cross-section rules and derived values (rules.py)

    @property
    def world_size(self) -> int:
        return self.cluster.nnodes * self.cluster.devices_per_node
