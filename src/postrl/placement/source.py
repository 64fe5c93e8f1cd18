"""Where the trainer's batches come from: its only view of rollout (DESIGN.md section 12).

    trainer loop --> BatchSource:  next_batch(step, timer) -> (Batch, stats)
                                   publish(model, version) -> stats      validation_engine(model)     close()
                         |                                  |
                     Colocated (placement colocated)    Worker (placement worker)              Pool (placement pool)
                     this rank's engine, Experience     a worker process (async_rollout.py)    Ray replicas dealt prompt
                     .collect between updates           makes batches ahead, transport.py      chunks (rollout_pool.py)

The loop reads the same whatever the source: it asks for step s's batch, trains on it, publishes the
weights after s + 1 updates. A new placement (a pool of rollout replicas, an OpenAI-compatible endpoint)
is one more class with these four methods, chosen by `open_source` from the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from postrl import distributed, guards
from postrl.errors import UserError
from postrl.experience import Batch
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


class Colocated:
    """sync: this rank's engine generates between updates with the trainer's own weights (`Experience`)."""

    def __init__(self, cfg: Any, run: Any, guard: guards.Guards, step: int, log: Callable[[str], None]):
        self.experience, self.guard, self.runtime = run.experience, guard, run.runtime  # the engine: experience.engine
        examples, experience = run.examples, run.experience
        self.probe = examples[0].prompt_ids if not examples[0].multi_modal else None  # the sync guard's (a text prompt)
        guards.note_uncorrectable(cfg, experience.engine, log)

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


class Worker:
    """async: rank 0's worker process (async_rollout.AsyncRollout) makes the batches of the steps ahead,
    within rollout.max_staleness; under several ranks its batches are broadcast to all. The trainer's own
    engine serves validation only. A worker that died is restarted from the trained position
    (rollout.max_worker_restarts), then the run stops."""

    def __init__(self, cfg: Any, run: Any, guard: guards.Guards, step: int, log: Callable[[str], None]):
        from postrl.runtime import threads_for

        self.cfg, self.log, self.engine, self.sampler = cfg, log, run.engine, run.sampler
        self.rollout = None
        rt, model = run.runtime, run.policy.model
        if not rt.is_main:
            self.publish(model, step)  # rank 0's worker takes the first weights (a gather under FSDP2)
            return
        lend = (rt.world_size == 1 and not isinstance(cfg.train.num_threads, int)
                and threads_for(model, cfg.train.num_threads, per_rank=2)[0] is not None)  # fmt: skip
        self.rollout = self.opens()(cfg, model, run.examples, run.sampler.state_dict(), step, torch.get_num_threads(), log, lend=lend)
        self.rollout.borrow_in(model, *([run.ref_model] if run.ref_model not in (None, model) else []))
        if isinstance(self, Pool):
            return
        log(f"rollout: async, a worker process at most {cfg.rollout.max_staleness} update(s) behind"
            + (", partial rollout" if cfg.rollout.partial_rollout else "")
            + (f", its batches broadcast to {rt.world_size} ranks" if rt.world_size > 1 else ""))  # fmt: skip

    @staticmethod
    def opens() -> type:
        from postrl.placement.worker import AsyncRollout

        return AsyncRollout

    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """Rank 0 takes the worker's batch, then broadcasts it; a data error the worker raised stops every rank."""
        got = None
        if self.rollout is not None:
            try:
                got = self._receive(step, timer)
            except UserError as exc:
                if not distributed.is_distributed():
                    raise
                got = exc
        got = distributed.broadcast_object(got)
        if isinstance(got, UserError):
            raise got
        batch, stats, seconds, sampler = got
        for name, value in seconds.items():  # the worker's rollout / reward time: timing/rollout, timing/reward
            timer.seconds[name] = timer.seconds.get(name, 0.0) + value
        self.sampler.load_state_dict(sampler)
        return batch, stats

    def _receive(self, step: int, timer: Timer):
        from postrl.placement.worker import WORKER_LOG, WorkerDied

        while True:
            try:
                with timer("wait_rollout"):
                    return self.rollout.next_batch(step)
            except WorkerDied as exc:
                if self.rollout.restarts >= self.cfg.rollout.max_worker_restarts:
                    raise UserError(
                        f"{exc} (its traceback, if it raised: {Path(self.cfg.logging.dir) / WORKER_LOG}), and it was "
                        f"restarted {self.rollout.restarts} time(s) already (rollout.max_worker_restarts). Fix the cause "
                        "it names, or raise rollout.max_worker_restarts.", title="the rollout worker failed",
                    ) from None
                self.rollout.restart(self.sampler.state_dict(), step, str(exc))

    def publish(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Rank 0 writes the weights for the worker; under FSDP2 every rank joins the gather. The worker checks
        them (the sync guard on every version it loads, the checksum on every batch)."""
        if self.rollout is not None:
            self.rollout.publish(model, version)
        else:
            from postrl.placement.transport import join_publish

            join_publish(model)
        return {}

    def validation_engine(self, model: torch.nn.Module) -> RolloutEngine:
        self.engine.sync_weights(model)  # behind since the last validation
        return self.engine

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()


class Pool(Worker):
    """pool: rollout replicas as Ray actors on their own cores / devices (rollout_pool.RolloutPool), dealt
    prompt chunks as they free up, weights by broadcast; the rest is the worker's (rank 0 takes the batches
    and broadcasts them, a pool whose every replica failed is restarted like a worker)."""

    @staticmethod
    def opens() -> type:
        from postrl.placement.pool import RolloutPool

        return RolloutPool


SOURCES = {"colocated": Colocated, "worker": Worker, "pool": Pool}  # rollout.placement -> where batches come from


def open_source(cfg: Any, run: Any, guard: guards.Guards, step: int, log: Callable[[str], None]) -> BatchSource:
    """The batch source `rollout.placement` names (derived from rollout.mode when unset), for the trainer's `run` (assembly.py) from `step` on (a resumed
    run's); `guard` checks that the engine holds the published weights."""
    return SOURCES[cfg.rollout.placement](cfg, run, guard, step, log)
