"""The agent wrapper of a policy's rollout engine, chosen from the rollout config (the assembly calls it for
every engine that rolls the policy out: training, the rollout worker and replicas, eval, doctor, SFT's check):

    rollout.agent        the OpenAI-compatible endpoint running the user's agent program (gateway.py)
    rollout.environment  that endpoint running a verifiers environment (agents/verifiers/env.py)
    rollout.multi_turn   postrl's agent loop (loop.py)
    none of them         the engine as it is
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from postrl.config import RolloutConfig
    from postrl.rollout import RolloutEngine


def wrap_engine(engine: "RolloutEngine", tokenizer: Any, cfg: "RolloutConfig", *, model: Any = None, log: Any = None,
                max_model_len: int | None = None) -> "RolloutEngine":  # fmt: skip
    """`engine` in the agent wrapper `cfg` names (module docstring), or `engine` itself."""
    if cfg.agent:
        from postrl.agents.endpoint.gateway import AgentGateway

        return AgentGateway(engine, tokenizer, cfg, model=model, log=log, max_model_len=max_model_len)
    if cfg.environment:
        from postrl.agents.verifiers.env import make_verifiers_engine

        return make_verifiers_engine(engine, tokenizer, cfg, model=model, log=log, max_model_len=max_model_len)
    if not cfg.multi_turn.enable:
        return engine
    from postrl.agents.loop.loop import AgentLoop

    return AgentLoop(engine, tokenizer, cfg.multi_turn, model=model, log=log)
