"""The rollout engine protocol.

An engine knows token ids, not text: it takes prompt token ids and returns completion token ids
(nanochat's shape). Two engines implement it: `HFEngine` (transformers `generate`) and `VLLMEngine`
(vLLM, CPU or GPU). `make_engine` picks one from `rollout.engine` (auto | hf | vllm).

`cut_at_stop` is the one cut of sampled ids at a stop string (the endpoint's `stop`, the agent loop's
`</tool_call>` where it is no single token): a bisection, so a turn of n tokens costs about log2(n) decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


class SamplingStopped(RuntimeError):
    """A stop event ended sampling before its completions were done (serve-tinker stopping on SIGTERM)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every engine (one to one with vLLM's SamplingParams)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    max_tokens: int = 64
    n: int = 1
    seed: int | None = None  # seeds the whole call; the same seed gives the same completions
    greedy: bool = False  # temperature 0: argmax decoding, n must be 1
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end a completion like EOS, kept in it (agents: </tool_call>)
    top_logprobs: int = 0  # engines that report log-probs: also the top-k of each sampled position (postrl doctor)


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared by the engine so the trainer never tests its name.

    reports_logprobs: `Completion.logprobs` holds the engine's sampling log-probs (rollout correction
        and the drift guard need them; an engine that samples with the trainer's own model has none).
    shares_trainer_model: the engine generates with the trainer's model object, so `sync_weights`
        copies nothing and a sharded (FSDP2) policy must be unsharded around each generate call.
    can_sleep: `sleep()` can free device memory for the update (whether it does is the engine's
        setting, e.g. rollout.enable_sleep_mode on GPU vLLM); False: sleep() is always a no-op.
    continuous_batching: `generate_continuing` runs requests as one continuous batch in which finished
        requests are followed by new ones (vLLM; the agent loop's turns join it). False: it raises.

    Where rollout runs (this process, a worker process, a pool) is not an engine's property: it is the
    trainer's batch source (postrl.placement).
    """

    reports_logprobs: bool
    shares_trainer_model: bool
    can_sleep: bool
    continuous_batching: bool = False


@dataclass
class Completion:
    """One sampled completion of one prompt: a token-level trajectory (DESIGN.md section 10).

    `token_ids` ends with the EOS token when the model stopped by itself (`finished`); otherwise it
    was cut at max_tokens. `logprobs` are the engine's sampling log-probs of `token_ids` under the
    temperature-scaled distribution (one per token, 0.0 where `loss_mask` is 0), or None when the
    engine does not report them.

    A multi-turn trajectory (an agent's) interleaves model turns with tokens the policy did not
    sample (tool results, environment or user turns) in one `token_ids` list: `loss_mask` has one
    entry per token, 1 where the policy sampled it, 0 elsewhere; only 1s are trained on. None means
    every token was sampled by the policy (single turn). `turn_spans` holds [start, end) of each
    model turn inside `token_ids` (None: one turn).

    `version` is the policy version (trainer step) whose weights sampled it; None: the weights the
    trainer gave the engine last, which Experience stamps with the trainer's step (sync rollout). An
    engine that runs behind the trainer (async, DESIGN.md section 10) sets it itself, and
    `token_versions` (one per token) when a partial rollout continued the sequence under newer
    weights; `version` is then its oldest token's.
    """

    prompt_index: int
    token_ids: list[int]
    finished: bool
    logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    turn_spans: list[tuple[int, int]] | None = None
    tool_calls: int = 0  # the agent loop: tool calls this trajectory made
    env_reward: float = 0.0  # the agent loop: what its environment (rollout.multi_turn.interaction) returned, summed
    version: int | None = None
    token_versions: list[int] | None = None
    # the agent gateway (agents/endpoint/gateway.py): the trajectory's own prompt when it is not the dataset row's (the
    # user's program rendered it), and the trajectory's other segments (DESIGN.md section 12), which train
    # as samples of their own with this one's reward and advantage
    prompt_ids: list[int] | None = None
    segments: list["Completion"] | None = None
    # SamplingParams.top_logprobs k > 0: per token, the ids and log-probs of the k most likely tokens there
    top_logprobs: list[tuple[list[int], list[float]]] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Everything a caller may use of a rollout engine (the trainer, Experience, the agent loop, the async
    worker, validation, doctor). Wrappers (`EngineWrapper`) forward each member by name: no caller probes
    an engine with `hasattr`."""

    name: str  # for messages and the guides' metric names (vllm_tps); behaviour follows `capabilities`
    capabilities: EngineCapabilities

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, multi_modal: list[dict] | None = None
    ) -> list[Completion]:
        """Sample `params.n` completions per prompt.

        Returns len(prompts) * n completions, prompt-major: completion k of prompt i is at
        index i * n + k, so a GRPO group is a contiguous slice.
        `multi_modal`, when given, holds one dict per prompt for vision-language models.
        """
        ...

    def generate_continuing(self, requests: list, on_finish: Callable, seed: int | None = None) -> None:
        """One continuous batch of (key, prompt ids, params) requests; `on_finish` gets the finished ones
        and returns new requests that join the batch (the agent loop, vllm.py). Only engines whose
        `capabilities.continuous_batching` is True implement it."""
        ...

    def sync_weights(self, model: "torch.nn.Module") -> None:
        """Load the trainer's current weights into the engine (no disk) and reset its caches."""
        ...

    def set_threads(self, n: int) -> None:
        """The CPU threads of the next generation calls (the async worker lends and borrows them); a no-op
        for an engine that runs on the process's own threads or on an accelerator."""
        ...

    def pop_metrics(self) -> dict[str, float]:
        """What the engine counted since the last call (the agent loop: agent/*, timing/agent_*), then reset;
        {} for an engine that counts nothing."""
        ...

    def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        """Log-probs of token_ids[1:] under the engine's weights at temperature 1 (the sync guard), or
        None when the engine shares the trainer's model object."""
        ...

    def probe_routing(self, token_ids: list[int], top_k: int) -> Any:
        """MoE: the experts [L, N, K] the engine's routers pick for each token (the sync guard's routing
        mismatch), or None (a dense model, or an engine that shares the trainer's model)."""
        ...

    def sleep(self) -> None:
        """Free what the engine holds on the device during the update (GPU vLLM); a no-op elsewhere."""
        ...

    def close(self) -> None:
        """Release the engine at the end of the run."""
        ...


class EngineWrapper:
    """An engine around an engine (the agent loop, the async worker's versioned engine, the FSDP2 unshard):
    every member of the protocol forwards to `self.engine`; a wrapper overrides what it changes."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.name = engine.name
        self.capabilities = engine.capabilities

    def generate(self, prompts, params, multi_modal=None, **kw) -> list[Completion]:
        return self.engine.generate(prompts, params, multi_modal=multi_modal, **kw)

    def generate_continuing(self, requests, on_finish, seed=None) -> None:
        self.engine.generate_continuing(requests, on_finish, seed=seed)

    def sync_weights(self, model: "torch.nn.Module") -> None:
        self.engine.sync_weights(model)

    def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        return self.engine.probe_logprobs(token_ids)

    def probe_routing(self, token_ids: list[int], top_k: int) -> Any:
        return self.engine.probe_routing(token_ids, top_k)

    def set_threads(self, n: int) -> None:
        self.engine.set_threads(n)

    def pop_metrics(self) -> dict[str, float]:
        return self.engine.pop_metrics()

    def sleep(self) -> None:
        self.engine.sleep()

    def close(self) -> None:
        self.engine.close()


def eos_token_ids(model: "torch.nn.Module", tokenizer: Any) -> list[int]:
    """The ids that end a completion: the model's generation_config EOS ids plus the tokenizer's EOS."""
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def cut_at_stop(tokenizer: Any, ids: list[int], stops: list[str]) -> tuple[list[int], bool]:
    """The ids through the token that completes the first stop string (the program sees the text before it).
    The shortest such prefix is found by bisection: a prefix's text grows with it, so once it holds a stop
    string every longer one does; O(log n) decodes, not n."""

    def holds(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        return any(s in text for s in stops)

    if not holds(len(ids)):
        return ids, False
    lo, hi = 1, len(ids)  # holds(hi); the answer is the least k with holds(k)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    return ids[:lo], True
