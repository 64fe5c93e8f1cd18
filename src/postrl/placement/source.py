"""Where the trainer's batches come from: its only view of rollout (DESIGN.md section 12).

    trainer loop --> BatchSource:  next_batch(step, timer) -> (Batch, stats)
                                   publish(model, version) -> stats      validation_engine(model)     close()
                         |                                  |
                     colocated.Colocated                remote.RemoteSource (rank 0 drives a Backend, broadcasts)
                     this rank's engine, Experience         |                                   |
                     .collect between updates           worker.AsyncRollout                 pool.RolloutPool
                                                        a worker process beside the         Ray replicas (replica.py)
                                                        trainer, shared-memory weights      dealt prompt chunks,
                                                        (transport.py)                      weights by broadcast

The loop reads the same whatever the source: it asks for step s's batch, trains on it, publishes the
weights after s + 1 updates. Every placement collects through experience.DynamicSampling (filter, refill,
agent segments, agent metrics). A new placement is one more BatchSource (or, for batches made elsewhere,
one more remote.Backend), chosen in `open_source` from `rollout.placement`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from postrl import guards
from postrl.batch import Batch
from postrl.metrics import Timer
from postrl.rollout import RolloutEngine


class BatchSource(Protocol):
    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """The global batch step `step` trains on (the same on every rank) and its rollout metrics; the
        trainer's prompt sampler is at the position after its prompts. Time spent goes into `timer`."""
        ...

    def publish(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """The trainer's weights after `version` updates, for the next batches (a collective: every rank
        calls it); returns what the sync guard measured. A version may be published again (a back-off)."""
        ...

    def validation_engine(self, model: torch.nn.Module) -> RolloutEngine:
        """An engine holding `model`'s current weights, for validation."""
        ...

    def close(self) -> None: ...


PLACEMENTS = ("colocated", "worker", "pool")  # rollout.placement


def open_source(cfg: Any, run: Any, guard: guards.Guards, step: int, log: Callable[[str], None]) -> BatchSource:
    """The batch source `rollout.placement` names, for the trainer's `run` (assembly.py) from `step` on (a
    resumed run's); `guard` checks that the engine holds the published weights."""
    placement = cfg.rollout.placement
    if placement == "colocated":
        from postrl.placement.colocated import Colocated

        return Colocated(cfg, run, guard, step, log)
    from postrl.placement.remote import RemoteSource

    if placement == "worker":
        from postrl.placement.worker import AsyncRollout

        return RemoteSource(cfg, run, step, log, AsyncRollout.open)
    assert placement == "pool", f"unknown rollout.placement {placement!r}"
    from postrl.placement.pool import RolloutPool

    return RemoteSource(cfg, run, step, log, RolloutPool.open)
