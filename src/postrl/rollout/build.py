"""`build_engine`: the one place a rollout engine is made from the run config (HF or vLLM), with the same
settings for every caller: trust_remote_code, max_model_len, seed, modality, runtime.

It sits below the assembly and the rewards, which both use it: the policy's engine (trainer, rollout worker
and replicas, eval, doctor, SFT's check: postrl.assembly.policy_engine, which puts the agent wrapper around
it) and the judge's (postrl.rewards.judge).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from postrl.rollout import RolloutEngine, make_engine

if TYPE_CHECKING:
    from postrl.models import Policy
    from postrl.runtime import Runtime


def build_engine(cfg, policy: Policy, runtime: Runtime | None, log: Any = None, *, max_tokens: int | None = None,
                 rollout: Any = None) -> RolloutEngine:  # fmt: skip
    """The rollout engine of `policy` (model, tokenizer, modality) from `rollout` (default cfg.rollout): KV cache
    sized for data.max_prompt_length + `max_tokens` (default rollout.max_tokens), seeded with train.seed."""
    rollout = rollout if rollout is not None else cfg.rollout
    return make_engine(
        rollout, policy.model, policy.tokenizer, log=log, max_model_len=max_model_len(cfg, rollout, max_tokens), seed=cfg.train.seed,
        modality=policy.modality, trust_remote_code=cfg.model.trust_remote_code, runtime=runtime,
    )  # fmt: skip


def max_model_len(cfg, rollout: Any, max_tokens: int | None = None) -> int:
    """Prompt + response tokens an engine of this run holds: data.max_prompt_length + `max_tokens` (default
    the rollout config's)."""
    return cfg.data.max_prompt_length + (max_tokens or rollout.max_tokens)
