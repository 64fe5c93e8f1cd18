"""The rollout engine of a rank whose policy is FSDP2-sharded (the colocated placement under FSDP2)."""

from __future__ import annotations

from typing import Any

import torch

from postrl.distributed import is_sharded, unsharded
from postrl.rollout.base import EngineWrapper


class _GenerateUnsharded(EngineWrapper):
    """An engine whose model is FSDP2-sharded: each generate call runs inside `unsharded(model)`."""

    def __init__(self, engine: Any, model: torch.nn.Module):
        super().__init__(engine)
        self.model = model

    def generate(self, prompts, params, multi_modal=None, **kwargs):  # kwargs: the agent loop's rows
        with unsharded(self.model):
            return self.engine.generate(prompts, params, multi_modal, **kwargs)

    def generate_continuing(self, requests, on_finish, seed=None) -> None:
        with unsharded(self.model):
            self.engine.generate_continuing(requests, on_finish, seed=seed)


def colocate(engine: Any, model: torch.nn.Module) -> Any:
    """The rollout engine of this rank, able to generate with a sharded policy.

    The HF engine generates with the policy object itself; when that is FSDP2-sharded, generation is
    bracketed by an unshard / reshard. The vLLM engine keeps its own weights and receives the full
    tensors in `sync_weights`, so it is returned unchanged.
    """
    if is_sharded(model) and engine.capabilities.shares_trainer_model:
        return _GenerateUnsharded(engine, model)
    return engine
