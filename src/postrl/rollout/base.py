"""The rollout engine protocol.

An engine knows token ids, not text: it takes prompt token ids and returns completion token ids
(nanochat's shape). Two engines implement it: `HFEngine` (transformers `generate`) and `VLLMEngine`
(vLLM, CPU or GPU). `make_engine` picks one from `rollout.engine` (auto | hf | vllm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from postrl.config import RolloutConfig


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


@dataclass
class Completion:
    """One sampled completion of one prompt.

    `token_ids` ends with the EOS token when the model stopped by itself (`finished`); otherwise it
    was cut at max_tokens. `logprobs` are the engine's sampling log-probs of `token_ids` under the
    temperature-scaled distribution, or None when the engine does not report them.
    """

    prompt_index: int
    token_ids: list[int]
    finished: bool
    logprobs: list[float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine."""

    name: str

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, multi_modal: list[dict] | None = None
    ) -> list[Completion]:
        """Sample `params.n` completions per prompt.

        Returns len(prompts) * n completions, prompt-major: completion k of prompt i is at
        index i * n + k, so a GRPO group is a contiguous slice.
        `multi_modal`, when given, holds one dict per prompt for vision-language models.
        """
        ...

    def sync_weights(self, model: "torch.nn.Module") -> None:
        """Load the trainer's current weights into the engine (no disk) and reset its caches."""
        ...


def make_engine(
    cfg: "RolloutConfig",
    model: "torch.nn.Module",
    tokenizer: Any,
    log: Any = None,
    max_model_len: int | None = None,
    seed: int = 0,
    *,
    trust_remote_code: bool = False,
) -> RolloutEngine:
    """Build the engine that `cfg.engine` names; `auto` tries vLLM and falls back to HF.

    `max_model_len` (prompt + response tokens) keeps vLLM's KV cache to what the run needs; without it
    a long-context model would not fit a small CPU cache. It is capped at the model's own maximum.
    `trust_remote_code` is the user's `model.trust_remote_code`, passed to vLLM as is.
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_model_len is not None and isinstance(limit, int) and max_model_len > limit:
        max_model_len = limit
    from postrl.rollout.hf import HFEngine

    def say(msg: str) -> None:
        if log is not None:
            log(msg)

    if cfg.engine == "hf":
        say("rollout engine: hf (transformers generate)")
        return HFEngine(model, tokenizer)
    try:
        from postrl.rollout.vllm import VLLMEngine, VLLMUnavailable
    except ImportError as exc:  # the module itself is missing: treat as vLLM unavailable
        if cfg.engine == "vllm":
            from postrl.errors import UserError

            raise UserError(f"rollout.engine is 'vllm' but postrl's vLLM engine cannot be imported ({exc}).") from exc
        say(f"rollout engine: hf (vLLM unavailable: {exc})")
        return HFEngine(model, tokenizer)
    try:
        engine = VLLMEngine(model, tokenizer, cfg, max_model_len=max_model_len, seed=seed, trust_remote_code=trust_remote_code)
    except VLLMUnavailable as exc:
        if cfg.engine == "vllm":
            from postrl.errors import UserError

            raise UserError(str(exc)) from exc
        say(f"[yellow]rollout engine: hf (falling back: {exc})[/yellow]")
        return HFEngine(model, tokenizer)
    say("rollout engine: vllm")
    return engine
