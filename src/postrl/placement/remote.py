"""A batch source whose batches are made outside the trainer's processes, ahead of the step that trains on
them (`rollout.placement: worker` and `pool`): rank 0 drives a Backend, takes each batch from it and
broadcasts it to every rank; a backend that failed is restarted from the trained position
(rollout.max_worker_restarts), then the run stops with a checkpoint (trainer.py).

    RemoteSource (every rank)  --drives-->  Backend (rank 0): worker.AsyncRollout | pool.RolloutPool
      next_batch(step, timer)                 next_batch(step) -> batch, stats, seconds, sampler position
      publish(model, version)                 publish(model, version); borrow_in(*models)
                                              restart(sampler, step, why); restarts; close()

A new placement whose batches come from elsewhere (a router over remote servers, say) is one more Backend
and one line in source.open_source.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from postrl import distributed
from postrl.errors import UserError
from postrl.batch import Batch
from postrl.metrics import Timer
from postrl.rollout import RolloutEngine


class WorkerDied(Exception):
    """The backend's rollout process(es) exited or raised (not a data error): restart it or stop. `hint` says
    where its traceback is, when it left one."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class Backend(Protocol):
    """What RemoteSource drives on rank 0 (worker.AsyncRollout, pool.RolloutPool)."""

    restarts: int  # how many times restart was called

    def borrow_in(self, *models: torch.nn.Module) -> None:
        """The trainer's models that may borrow the backend's idle threads (a no-op where it has cores of its own)."""

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's weights after `version` updates (a version may be published again: a back-off)."""

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float], dict[str, float], dict]:
        """Step `step`'s batch (waits for it), its metrics, the rollout time split, the sampler position after
        its prompts. Raises WorkerDied when the rollout side failed, UserError for a data error."""
        ...

    def restart(self, sampler: dict, step: int, why: str) -> None:
        """Start again from the trained position (`sampler`, `step`): what was in flight is made again."""

    def close(self) -> None: ...


Opens = Callable[[Any, Any, int, Callable[[str], None]], Backend]  # (cfg, run, step, log) -> the backend


class RemoteSource:
    """The BatchSource of a placement whose batches a Backend makes (opened by `opens` on rank 0). The
    trainer's own engine serves validation only."""

    def __init__(self, cfg: Any, run: Any, step: int, log: Callable[[str], None], opens: Opens):
        self.cfg, self.log, self.engine, self.sampler = cfg, log, run.engine, run.sampler
        self.rollout: Backend | None = None
        model = run.policy.model
        if not run.runtime.is_main:
            self.publish(model, step)  # rank 0's backend takes the first weights (a gather under FSDP2)
            return
        self.rollout = opens(cfg, run, step, log)
        self.rollout.borrow_in(model, *([run.ref_model] if run.ref_model not in (None, model) else []))

    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """Rank 0 takes the backend's batch, then broadcasts it; a data error it raised stops every rank."""
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
        for name, value in seconds.items():  # the rollout side's rollout / reward time: timing/rollout, timing/reward
            timer.seconds[name] = timer.seconds.get(name, 0.0) + value
        self.sampler.load_state_dict(sampler)
        return batch, stats

    def _receive(self, step: int, timer: Timer):
        assert self.rollout is not None
        while True:
            try:
                with timer("wait_rollout"):
                    return self.rollout.next_batch(step)
            except WorkerDied as exc:
                if self.rollout.restarts >= self.cfg.rollout.max_worker_restarts:
                    raise UserError(
                        f"{exc}{exc.hint}, and it was restarted {self.rollout.restarts} time(s) already "
                        "(rollout.max_worker_restarts). Fix the cause it names, or raise rollout.max_worker_restarts.",
                        title="the rollout worker failed",
                    ) from None
                self.rollout.restart(self.sampler.state_dict(), step, str(exc))

    def publish(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Rank 0 hands the weights to the backend; under FSDP2 every rank joins the gather. The rollout side
        checks them (the sync guard on every version it loads, the checksum on every batch)."""
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
