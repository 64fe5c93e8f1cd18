"""`rollout.placement: colocated`: this rank's engine generates between updates with the trainer's own
weights (Experience.collect), then sleeps (GPU vLLM frees its KV cache) while the update runs."""

from __future__ import annotations

from typing import Any, Callable

import torch

from postrl import guards
from postrl.batch import Batch
from postrl.metrics import Timer
from postrl.rollout import RolloutEngine


class Colocated:
    """The BatchSource of the colocated placement; the engine is the run's (Run.close releases it)."""

    def __init__(self, cfg: Any, run: Any, guard: guards.Guards, step: int, log: Callable[[str], None]):
        self.experience, self.guard, self.runtime = run.experience, guard, run.runtime  # the engine: experience.engine
        examples = run.examples
        self.probe = examples[0].prompt_ids if not examples[0].multi_modal else None  # the sync guard's (a text prompt)
        guards.note_uncorrectable(cfg, run.experience.engine, log)

    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        batch, stats = self.experience.collect(step, timer)
        with timer("resharding_to_train"):
            self.experience.engine.sleep()  # GPU vLLM: free the KV cache and offload weights for the update
        return batch, stats

    def publish(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        engine = self.experience.engine
        engine.sync_weights(model)
        if self.probe is None:
            return {}
        return self.guard.check_sync(engine, model, self.probe, self.runtime.autocast())

    def validation_engine(self, model: torch.nn.Module) -> RolloutEngine:
        return self.experience.engine  # synced at every publish

    def close(self) -> None:
        """The engine is the run's (Run.close releases it)."""
