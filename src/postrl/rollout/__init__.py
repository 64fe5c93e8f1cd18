"""Rollout engines: generate completions for prompts given as token ids.

`base.py` holds the protocol and the shared records; `hf.py` (transformers generate) and `vllm.py`
(vLLM, CPU or GPU) implement it; `make_engine` picks one from `rollout.engine` (auto | hf | vllm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from postrl.rollout.base import Completion, EngineCapabilities, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    import torch

    from postrl.config import RolloutConfig
    from postrl.modality import Modality
    from postrl.runtime import Runtime

__all__ = ["Completion", "EngineCapabilities", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(
    cfg: "RolloutConfig",
    model: "torch.nn.Module",
    tokenizer: Any,
    log: Any = None,
    max_model_len: int | None = None,
    seed: int = 0,
    modality: "Modality | None" = None,
    *,
    trust_remote_code: bool = False,
    runtime: "Runtime | None" = None,
    model_dir: str | None = None,
) -> RolloutEngine:
    """Build the engine that `cfg.engine` names; `auto` tries vLLM and falls back to HF.

    `max_model_len` (prompt + response tokens) keeps vLLM's KV cache to what the run needs; without it
    a long-context model would not fit a small CPU cache. It is capped at the model's own maximum.
    `modality` is the policy's adapter (None: text).
    `trust_remote_code` is the user's `model.trust_remote_code`, passed to vLLM as is.
    `runtime` gives the compute dtype: HF generates under its autocast, vLLM holds weights in it
    (None: the dtype of the model's parameters, no autocast).
    `model_dir`: vLLM builds from this directory's config.json instead of the model's own.
    The engine only: the agent wrappers (rollout.multi_turn, rollout.agent, rollout.environment) are put
    around it by the assembly (postrl.agents.wrap), above this package.
    """
    return _engine(cfg, model, tokenizer, log, max_model_len, seed, modality, trust_remote_code, runtime, model_dir)


def _engine(cfg, model, tokenizer, log, max_model_len, seed, modality, trust_remote_code, runtime, model_dir) -> RolloutEngine:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_model_len is not None and isinstance(limit, int) and max_model_len > limit:
        max_model_len = limit
    from postrl.rollout.hf import HFEngine

    def say(msg: str) -> None:
        if log is not None:
            log(msg)

    if cfg.engine == "hf":
        say("rollout engine: hf (transformers generate)")
        return HFEngine(model, tokenizer, modality=modality, runtime=runtime)
    try:
        from postrl.rollout.vllm import VLLMEngine, VLLMUnavailable
    except ImportError as exc:  # the module itself is missing: treat as vLLM unavailable
        if cfg.engine == "vllm":
            from postrl.errors import UserError

            raise UserError(f"rollout.engine is 'vllm' but postrl's vLLM engine cannot be imported ({exc}).") from exc
        say(f"rollout engine: hf (vLLM unavailable: {exc})")
        return HFEngine(model, tokenizer, modality=modality, runtime=runtime)
    try:
        engine = VLLMEngine(
            model, tokenizer, cfg, max_model_len=max_model_len, seed=seed, modality=modality, trust_remote_code=trust_remote_code,
            dtype=runtime.dtype if runtime is not None else None, model_dir=model_dir,
        )  # fmt: skip
    except VLLMUnavailable as exc:
        if cfg.engine == "vllm":
            from postrl.errors import UserError

            raise UserError(str(exc)) from exc
        say(f"[yellow]rollout engine: hf (falling back: {exc})[/yellow]")
        return HFEngine(model, tokenizer, modality=modality, runtime=runtime)
    say(f"rollout engine: vllm ({'eager' if cfg.enforce_eager else 'compiled'})")
    if engine.moe:
        from postrl.moe import REPLAY_UNAVAILABLE

        say(REPLAY_UNAVAILABLE)
    return engine
