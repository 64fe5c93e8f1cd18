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

The worker sends each batch back as bytes in a declared shape (placement/wire.py) down a pipe the trainer
reads with `recv_bytes` (never unpickled: the worker runs user agent programs over model output); a semaphore
of k + 1 slots bounds the batches made and not yet taken (the worker waits for a slot), and a thread of the
worker's writes them, so making the next batch goes on while the trainer reads. A reply that does not decode
is the worker's failure.

A worker that dies or raises is restarted from the trained position up to `rollout.max_worker_restarts`
times; past that (and at once for a data error the worker reports, which would recur) the run stops
with a checkpoint of the steps trained so far (remote.RemoteSource, trainer.py).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import postrl.placement.wire as wire
from postrl.children import scrub_environ
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
class _Spec:
    cfg: Any
    examples: list
    sampler: dict
    start: int
    threads: int
    parent: int
    log_dir: str
    quiet: bool = True


def passthrough(cfg: Any) -> list[str]:
    """The names a rollout process keeps beside the allowlist: those its agent programs and its verifiers are given."""
    return [*cfg.rollout.agent_env_passthrough, *cfg.reward.env_passthrough]


class _Sender:
    """The worker's thread that writes its replies down the pipe in order (the pipe blocks while the trainer
    has not read the last one; the worker goes on making the next batch meanwhile)."""

    def __init__(self, conn: Any):
        self.conn, self.items = conn, queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="postrl-rollout-sender")
        self.thread.start()

    def _run(self) -> None:
        while (data := self.items.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the trainer closed its end
                return

    def put(self, data: bytes) -> None:
        self.items.put(data)

    def flush(self, stop: Any, parent: int) -> None:
        """Wait until everything queued is sent, or the trainer stops reading (stop set, or it exited)."""
        self.items.put(None)
        while self.thread.is_alive() and not stop.is_set() and os.getppid() == parent:
            self.thread.join(POLL_S)


def _serve(spec: _Spec, weights: SharedWeights, out: Any, slots: Any, stop: Any, share: CoreShare) -> None:
    """The worker process: build the policy copy, engine and rewards, then produce batches until stopped; each is
    sent (encoded, wire.py) once a slot of the k + 1 is free."""
    from postrl.metrics import Timer

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops us
    scrub_environ(passthrough(spec.cfg), rollout=True)  # first: no token or home of the trainer's (children.py)
    for name in _RANK_ENV:  # rank 0's process-group settings: the worker is a job of its own (vLLM reads some)
        os.environ.pop(name, None)
    engine = reward_fn = None
    sender = _Sender(out)
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
            data = wire.encode_batch(index, batch, spec.examples, stats, dict(timer.seconds), sampler.state_dict(), dict(engine.checksums))
            with engine.share.waiting(WORKER) if engine.share else contextlib.nullcontext():  # while every slot is taken
                while not slots.acquire(timeout=POLL_S):
                    engine.check_stop()
            sender.put(data)
    except StopRequested:
        pass
    except BaseException as exc:  # reported to the trainer, which restarts the worker or stops with a checkpoint
        text = traceback.format_exc()
        try:
            Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(spec.log_dir) / WORKER_LOG).write_text(text)
        except OSError:
            pass
        sender.put(wire.encode_failure(exc))
        sender.flush(stop, spec.parent)
    finally:
        for part in (reward_fn, engine):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
        # the trainer may have stopped reading: exit without flushing (the sender thread is a daemon)


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
        self.vocab = wire.vocab_size(model)  # every reply's token ids are checked against it
        self.share = CoreShare(self.ctx, threads, lend)
        self.sums = PublishedChecksums(self.k)
        self.restarts = 0
        self.proc = None
        self.publish(model, step)
        self._start(sampler, step)

    def _start(self, sampler: dict, step: int) -> None:
        self.reader, writer = self.ctx.Pipe(duplex=False)  # read with recv_bytes only: nothing is unpickled
        self.slots = self.ctx.Semaphore(self.k + 1)  # batches made and not taken: the worker waits when none is free
        self.stop = self.ctx.Event()
        self.share.flags[WORKER] = 0  # a worker that died waiting lends nothing
        spec = _Spec(self.cfg, self.examples, sampler, step, self.threads, os.getpid(), self.cfg.logging.dir, not self.cfg.logging.verbose)
        self.proc = self.ctx.Process(target=_serve, args=(spec, self.weights, writer, self.slots, self.stop, self.share), name="postrl-rollout")
        self.proc.start()
        writer.close()  # the worker's end: its exit is the reader's EOF

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
        position after it. Raises WorkerDied / UserError when the worker fails; a reply that does not decode
        (wire.py) is the worker's failure."""
        start = time.perf_counter()
        with self.share.waiting(TRAINER):  # a worker blocked on the full queue wakes up as this takes a batch
            got = self._receive(step)
        if isinstance(got, wire.Failure):
            if got.user_error:
                raise UserError(*got.problems, title=got.title or "postrl cannot continue")
            raise WorkerDied(f"the rollout worker failed: {got.message}", self._traceback())
        if not isinstance(got, wire.Produced) or got.index != step:
            raise WorkerDied(f"the rollout worker sent {getattr(got, 'kind', '?')} {getattr(got, 'index', '')} for step {step}")
        self.slots.release()
        self.sums.verify(got.checksums, "the rollout worker")  # the sync guard of the transport: every version
        queued = self.k + 1 - self.slots.get_value()  # made and not taken
        batch, tail = take_fresh(got.batch.to_batch(self.examples), step, self.k, self.G, self.log, time.perf_counter() - start, queued)
        stats = {**got.stats, **tail}
        return batch, stats, got.seconds, got.sampler

    def _receive(self, step: int) -> wire.Produced | wire.Failure | wire.Chunk:
        """The worker's next reply, decoded; WorkerDied when it exited, closed the pipe or sent a bad reply."""
        while not self.reader.poll(POLL_S):
            if not self.proc.is_alive():
                raise WorkerDied(f"the rollout worker exited with code {self.proc.exitcode} without a batch for step {step}",
                                 self._traceback())  # fmt: skip
        try:
            return wire.decode(self.reader.recv_bytes(wire.MAX_REPLY_BYTES), len(self.examples), vocab=self.vocab)
        except EOFError:
            self.proc.join(POLL_S * 10)
            raise WorkerDied(f"the rollout worker exited with code {self.proc.exitcode} without a batch for step {step}",
                             self._traceback()) from None  # fmt: skip
        except (OSError, wire.WireError) as exc:  # recv_bytes' "bad message length": over the cap
            raise WorkerDied(f"the rollout worker sent a bad reply: {exc}") from None

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
                if self.reader.poll(0.2):
                    self.reader.recv_bytes(wire.MAX_REPLY_BYTES)  # a worker blocked sending: read and dropped
            except (EOFError, OSError):  # it exited, or the pipe holds a bad frame: wait for it, then kill it
                self.proc.join(max(0.0, deadline - time.monotonic()))
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.reader.close()
        self.proc = None
