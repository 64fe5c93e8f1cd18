"""`rollout.placement: worker`: a worker process beside the trainer generates and scores the batches of the
steps ahead while the trainer updates (docs/async.md).

    trainer process                                    rollout worker process (spawned)
    step s: next_batch(s) <- queue <- batch b=s+1 ... | policy copy + engine (vLLM / HF) + rewards
            update                                      | for b = start, start+1, ...:
            publish(model, s + 1) -> shared weights --> |   wait until its weights are >= b - k old
                                                        |   Experience.collect(b): rollout, rewards,
                                                        |     dynamic sampling (experience.DynamicSampling)

The worker makes batch b (the one step b trains on) only once it holds weights of version b - k or
newer (k = rollout.max_staleness), so no sequence reaches the trainer more than k updates old; it loads
the newest published weights before every generation call. Batch b uses the sampling seeds of sync
step b, so with k = 0 async reproduces sync exactly. Each batch carries the sampler position after its
prompts: the trainer keeps the position of the batches it trained on, so a resumed run regenerates
whatever was in flight and no prompt is skipped or trained twice.

Partial rollout (`rollout.partial_rollout`): generation runs in chunks of
`rollout.partial_rollout_chunk` tokens, and newer weights published between chunks are loaded and
continue the unfinished sequences; every token records the version that sampled it
(`Completion.token_versions`), the sequence's version is its oldest token's.

A worker that dies or raises is restarted from the trained position up to `rollout.max_worker_restarts`
times; past that (and at once for a data error the worker reports, which would recur) the run stops
with a checkpoint of the steps trained so far (remote.RemoteSource, trainer.py).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.distributed import RENDEZVOUS_FILE_ENV
from postrl.errors import UserError
from postrl.batch import Batch
from postrl.placement.checksums import PublishedChecksums
from postrl.placement.cores import TRAINER, WORKER, CoreShare
from postrl.placement.remote import WorkerDied
from postrl.placement.staleness import take_fresh
from postrl.placement.transport import SharedWeights
from postrl.placement.versioned import POLL_S, StopRequested, versioned

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", RENDEZVOUS_FILE_ENV)  # fmt: skip
WORKER_LOG = "rollout_worker.log"  # the worker's traceback when it fails, in logging.dir


@dataclass
class Produced:
    """One training batch from the worker: batch `index` (the step it is for), its scored groups, the
    collection's metrics, the worker's time split, the sampler position after its prompts, and the
    checksum of every weight version it sampled with."""

    index: int
    batch: Batch
    stats: dict[str, float]
    seconds: dict[str, float]
    sampler: dict
    checksums: dict[int, float]


@dataclass
class WorkerFailure:
    """What a failing worker sends before it exits: a UserError's parts, or another error's text."""

    message: str
    problems: tuple = ()
    title: str | None = None
    user_error: bool = False


@dataclass
class _Spec:
    cfg: Any
    examples: list
    sampler: dict
    start: int
    threads: int
    parent: int
    log_dir: str
    quiet: bool = True


def _serve(spec: _Spec, weights: SharedWeights, out: Any, stop: Any, share: CoreShare) -> None:
    """The worker process: build the policy copy, engine and rewards, then produce batches until stopped."""
    from postrl.metrics import Timer

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops us
    for name in _RANK_ENV:  # rank 0's process-group settings: the worker is a job of its own (vLLM reads some)
        os.environ.pop(name, None)
    engine = reward_fn = None
    try:
        if spec.quiet:
            from postrl.console import quiet_console

            quiet_console(spec.cfg.logging)
        torch.set_num_threads(spec.threads)
        engine, reward_fn, experience, sampler = _build(spec, weights, stop, share)
        for index in range(spec.start, 2**62):
            idle = engine.wait_for(index - spec.cfg.rollout.max_staleness)
            timer = Timer()
            batch, stats = experience.collect(index, timer)
            stats.update(engine.load_stats)
            stats["async/rollout_idle_s"] = idle
            produced = Produced(index, batch, stats, dict(timer.seconds), sampler.state_dict(), dict(engine.checksums))
            with engine.share.waiting(WORKER) if engine.share else contextlib.nullcontext():  # while the queue is full
                while True:
                    engine.check_stop()
                    try:
                        out.put(produced, timeout=POLL_S)
                        break
                    except queue.Full:
                        continue
    except StopRequested:
        pass
    except BaseException as exc:  # reported to the trainer, which restarts the worker or stops with a checkpoint
        text = traceback.format_exc()
        try:
            Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(spec.log_dir) / WORKER_LOG).write_text(text)
        except OSError:
            pass
        if isinstance(exc, UserError):
            out.put(WorkerFailure(str(exc), exc.problems, exc.title, user_error=True))
        else:
            out.put(WorkerFailure(f"{type(exc).__name__}: {exc}"))
    finally:
        for part in (reward_fn, engine):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
        out.cancel_join_thread()  # the trainer may have stopped reading: exit without flushing


def _build(spec: _Spec, weights: SharedWeights, stop, share: CoreShare):
    """The worker's part of the run (assembly.py's rollout-worker role): its policy copy holds the published
    weights, its engine is versioned, and it checks the engine on every version it loads (the sync guard)."""
    from postrl.assembly import build_run

    wrap = versioned(spec.cfg, spec.examples, lambda run: weights, stop, spec.parent, share)
    run = build_run(spec.cfg, "rollout-worker", examples=spec.examples, sampler_state=spec.sampler, prepare=weights.load, wrap=wrap)
    return run.engine, run.reward_fn, run.experience, run.sampler


class AsyncRollout:
    """The trainer's side of the worker (a remote.Backend): start it, take its batches, publish weights,
    restart it, stop it."""

    @classmethod
    def open(cls, cfg: Any, run: Any, step: int, log) -> "AsyncRollout":
        """The worker of the trainer's `run` from `step` on; on CPU, when the thread policy chose the count
        and there is one rank, the two sides lend each other their threads while they wait (CoreShare)."""
        from postrl.runtime import threads_for

        rt, model = run.runtime, run.policy.model
        lend = (rt.world_size == 1 and not isinstance(cfg.train.num_threads, int)
                and threads_for(model, cfg.train.num_threads, per_rank=2)[0] is not None)  # fmt: skip
        rollout = cls(cfg, model, run.examples, run.sampler.state_dict(), step, torch.get_num_threads(), log, lend=lend)
        log(f"rollout: async, a worker process at most {cfg.rollout.max_staleness} update(s) behind"
            + (", partial rollout" if cfg.rollout.partial_rollout else "")
            + (f", its batches broadcast to {rt.world_size} ranks" if rt.world_size > 1 else ""))  # fmt: skip
        return rollout

    def __init__(self, cfg, model: torch.nn.Module, examples: list, sampler: dict, step: int, threads: int, log, lend: bool = False):
        """`threads`: this process's CPU threads, and the worker's; `lend`: the two lend them to each other
        while they wait (CoreShare; on CPU when the thread policy chose the count)."""
        self.cfg, self.examples, self.threads, self.log = cfg, examples, threads, log
        self.k = cfg.rollout.max_staleness
        self.G = cfg.rollout.n_samples_per_prompt
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.weights = SharedWeights(model, self.ctx)
        self.share = CoreShare(self.ctx, threads, lend)
        self.sums = PublishedChecksums(self.k)
        self.restarts = 0
        self.proc = None
        self.publish(model, step)
        self._start(sampler, step)

    def _start(self, sampler: dict, step: int) -> None:
        self.queue = self.ctx.Queue(maxsize=self.k + 1)
        self.stop = self.ctx.Event()
        self.share.flags[WORKER] = 0  # a worker that died waiting lends nothing
        spec = _Spec(self.cfg, self.examples, sampler, step, self.threads, os.getpid(), self.cfg.logging.dir, not self.cfg.logging.verbose)
        self.proc = self.ctx.Process(target=_serve, args=(spec, self.weights, self.queue, self.stop, self.share), name="postrl-rollout")
        self.proc.start()

    def borrow_in(self, *models: torch.nn.Module) -> None:
        """Each forward of these models (the policy, the reference) runs on the worker's threads too while it waits."""
        if self.share.enabled:
            for model in models:
                model.register_forward_pre_hook(lambda module, args: self.share.take(TRAINER))

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's weights after `version` updates, for the worker's next generation call. The version
        last published may be published again with other weights (a back-off to the best weights)."""
        self.share.own()  # the worker waiting for them wakes up: its threads back first
        self.sums.add(version, self.weights.publish(model, version))

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float], dict[str, float], dict]:
        """The batch of `step` (waits for it): the batch, its metrics, the worker's time split, the sampler
        position after it. Raises WorkerDied / UserError when the worker fails."""
        start = time.perf_counter()
        with self.share.waiting(TRAINER):  # a worker blocked on the full queue wakes up as this takes a batch
            while True:
                try:
                    got = self.queue.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if not self.proc.is_alive():
                        raise WorkerDied(f"the rollout worker exited with code {self.proc.exitcode} without a batch for step {step}",
                                         self._traceback())
        if isinstance(got, WorkerFailure):
            if got.user_error:
                raise UserError(*got.problems, title=got.title)
            raise WorkerDied(f"the rollout worker failed: {got.message}", self._traceback())
        assert got.index == step, f"the rollout worker sent batch {got.index} for step {step}"
        self.sums.verify(got.checksums, "the rollout worker")  # the sync guard of the transport: every version
        batch, tail = take_fresh(got.batch, step, self.k, self.G, self.log, time.perf_counter() - start, self.queue.qsize())
        stats = {**got.stats, **tail}
        return batch, stats, got.seconds, got.sampler

    def _traceback(self) -> str:
        return f" (its traceback, if it raised: {Path(self.cfg.logging.dir) / WORKER_LOG})"

    def restart(self, sampler: dict, step: int, why: str) -> None:
        """A new worker from the trained position: what the old one had in flight is generated again."""
        self.restarts += 1
        self.log(f"[yellow]{why}; restarting it (restart {self.restarts} of {self.cfg.rollout.max_worker_restarts}) from step {step}[/yellow]")
        self.close()
        self._start(sampler, step)

    def close(self) -> None:
        """Stop the worker and wait for it (killed if it does not stop within 60 s)."""
        if self.proc is None:
            return
        self.stop.set()
        deadline = time.monotonic() + 60
        while self.proc.is_alive() and time.monotonic() < deadline:
            try:
                self.queue.get(timeout=0.2)  # a worker blocked on a full queue
            except queue.Empty:
                pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.queue.close()
        self.proc = None
