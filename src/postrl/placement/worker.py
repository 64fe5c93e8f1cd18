"""Async rollout (`rollout.mode: async`): a worker process generates and scores the batches of the steps
ahead while the trainer updates (docs/async.md).

    trainer process                                    rollout worker process (spawned)
    step s: next_batch(s) <- queue <- batch b=s+1 ... | policy copy + engine (vLLM / HF) + rewards
            update                                      | for b = start, start+1, ...:
            publish(model, s + 1) -> shared weights --> |   wait until its weights are >= b - k old
                                                        |   Experience.collect(b): rollout, rewards,
                                                        |     dynamic sampling (the sync loop's code)

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
with a checkpoint of the steps trained so far (batch_source.Worker, trainer.py).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from postrl.distributed import RENDEZVOUS_FILE_ENV
from postrl.errors import UserError
from postrl.experience import Batch, concat, select, select_groups
from postrl.rollout import Completion, SamplingParams
from postrl.rollout.base import EngineWrapper
from postrl.placement.transport import SharedWeights

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", RENDEZVOUS_FILE_ENV)  # fmt: skip
WORKER_LOG = "rollout_worker.log"  # the worker's traceback when it fails, in logging.dir
_POLL_S = 1.0  # how often a waiting side looks at the other one (it wakes at once when there is news)


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


class _Stop(Exception):
    """The trainer asked the worker to stop (or went away)."""


TRAINER, WORKER = 0, 1


class CoreShare:
    """On CPU the cores are split between the trainer and the worker (runtime.threads_for: `threads` each);
    a side that waits for the other lends it its threads. Each side marks the time it waits (`waiting`) and
    takes `threads(side)` at its next forward (the trainer) or generation call (the worker), so the trainer's
    update runs on every core once the worker has made its batch, and the worker's next call does while
    the trainer waits for it. A side drops back to its own share before it wakes the other (publishing
    weights, taking or handing over a batch), so the two never hold more threads than there are cores.
    Off (`enabled` False) on an accelerator or when the user fixed the thread count."""

    def __init__(self, ctx, threads: int, enabled: bool):
        self.base, self.enabled = threads, enabled
        self.flags = ctx.Array("b", 2, lock=False)  # [trainer, worker]: 1 while that side waits for the other

    def threads(self, side: int) -> int:
        return 2 * self.base if self.enabled and self.flags[1 - side] else self.base

    def take(self, side: int) -> None:
        """This side's thread count for what it does next (its share, plus the other's while that one waits)."""
        if self.enabled and (n := self.threads(side)) != torch.get_num_threads():
            torch.set_num_threads(n)

    def own(self) -> None:
        """Back to this side's own share (before waking the other side)."""
        if self.enabled and torch.get_num_threads() != self.base:
            torch.set_num_threads(self.base)

    @contextlib.contextmanager
    def waiting(self, side: int):
        self.own()
        self.flags[side] = 1
        try:
            yield
        finally:
            self.flags[side] = 0


# ------------------------------------------------------------------------------------- the worker


class VersionedEngine(EngineWrapper):
    """The worker's engine: loads newer published weights before each generation call, stamps every
    completion with the version that sampled it, and (partial rollout) continues unfinished sequences
    under weights that arrive mid-generation. An engine without sampling log-probs (HF) gets them from
    a forward pass of the worker's model right after each call, i.e. under the weights that sampled."""

    def __init__(self, engine, model, weights: SharedWeights, cfg, autocast, stop, parent: int, on_load=None, logprobs=True,
                 share: CoreShare | None = None):  # fmt: skip
        super().__init__(engine)
        self.capabilities = replace(engine.capabilities, continuous_batching=False)  # each call is stamped: no stream
        self.model, self.weights, self.cfg, self.autocast = model, weights, cfg, autocast
        self.share = share
        self.logprobs = logprobs and not engine.capabilities.reports_logprobs  # compute them (rollout correction needs q)
        self.stop, self.parent, self.on_load = stop, parent, on_load
        self.version, self.loaded = -1, -1  # the version held, and the publication it came from
        self.checksums: dict[int, float] = {}
        self.load_stats: dict[str, float] = {}

    def _load(self) -> None:
        self.loaded = self.weights.publications()  # read first: a copy published meanwhile is loaded next time
        self.version, self.checksums[self.version] = self.weights.load(self.model)
        self.engine.sync_weights(self.model)
        if self.on_load is not None:
            self.load_stats = self.on_load(self.engine, self.model) or {}

    def refresh(self) -> None:
        if self.weights.publications() != self.loaded:  # a newer version, or the same one again (back-off)
            self._load()

    def wait_for(self, version: int) -> float:
        """Block until weights of `version` or newer are loaded; returns the seconds spent waiting."""
        start = time.perf_counter()
        with self.share.waiting(WORKER) if self.share else contextlib.nullcontext():
            while self.weights.latest() < version:
                self.check_stop()
                self.weights.wait_newer(version - 1, _POLL_S)
        self.refresh()
        return time.perf_counter() - start

    def check_stop(self) -> None:
        if self.stop.is_set() or os.getppid() != self.parent:
            raise _Stop

    def generate(self, prompts, params: SamplingParams, multi_modal=None, **kw) -> list[Completion]:
        self.check_stop()
        self.refresh()
        if not self.cfg.partial_rollout or params.greedy:
            return self._call(prompts, params, multi_modal, **kw)
        chunk = self.cfg.partial_rollout_chunk
        out = self._call(prompts, replace(params, max_tokens=min(chunk, params.max_tokens)), multi_modal, **kw)
        done = chunk
        while done < params.max_tokens:
            live = [i for i, c in enumerate(out) if not c.finished]
            if not live:
                break
            self.check_stop()
            self.refresh()  # weights published since the last chunk sample the rest
            step = replace(params, n=1, max_tokens=min(chunk, params.max_tokens - done), seed=_chunk_seed(params.seed, done))
            mm = [multi_modal[out[i].prompt_index] for i in live] if multi_modal is not None else None
            more = self._call([list(prompts[out[i].prompt_index]) + out[i].token_ids for i in live], step, mm)
            for i, c in zip(live, more):
                out[i] = _extend(out[i], c)
            done += step.max_tokens
        return out

    def _call(self, prompts, params, multi_modal, **kw) -> list[Completion]:
        if self.share is not None:  # the trainer's threads too while it waits for this batch
            self.share.take(WORKER)
        self._engine_threads()
        try:
            completions = self.engine.generate(prompts, params, multi_modal=multi_modal, **kw)
            if not params.greedy and self.logprobs:
                _add_logprobs(self.model, prompts, completions, params.temperature, self.autocast, multi_modal)
        finally:
            if self.share is not None:
                self.share.own()
            self._engine_threads()  # the sync guard's probe between calls runs on the worker's own share
        for c in completions:
            c.version = self.version
            c.token_versions = [self.version] * len(c.token_ids)
        return completions

    def _engine_threads(self) -> None:
        """vLLM on CPU runs at the thread count it was given (VLLMEngine.set_threads): this process's now."""
        self.engine.set_threads(torch.get_num_threads())


def _chunk_seed(seed: int | None, done: int) -> int | None:
    return None if seed is None else (seed * 31 + done) % 2**31


def _extend(head: Completion, tail: Completion) -> Completion:
    """`head` continued by `tail` (sampled from head's prompt + tokens)."""
    return replace(
        head,
        token_ids=head.token_ids + tail.token_ids,
        finished=tail.finished,
        logprobs=None if head.logprobs is None or tail.logprobs is None else head.logprobs + tail.logprobs,
        token_versions=head.token_versions + tail.token_versions,
        version=min(head.version, tail.version),
    )


@torch.no_grad()
def _add_logprobs(model, prompts, completions: list[Completion], temperature: float, autocast, multi_modal) -> None:
    """Sampling log-probs of each completion under `model` (the weights that just sampled them) at the
    sampling temperature: the behaviour policy q of the decoupled objective, for engines that report none."""
    from postrl.models import build_sequences, response_logprobs

    rows = 64
    pad = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
    device = next(model.parameters()).device
    every = [x for c in completions for x in (c, *(c.segments or []))]  # rollout.agent: segments, own prompts
    for start in range(0, len(every), rows):
        part = every[start : start + rows]
        seq = build_sequences([list(c.prompt_ids or prompts[c.prompt_index]) for c in part], [c.token_ids for c in part], pad)
        seq = {k: v.to(device) for k, v in seq.items()}
        mm = [multi_modal[c.prompt_index] for c in part] if multi_modal is not None else None
        with autocast:
            logp, _ = response_logprobs(
                model, seq["input_ids"], seq["attention_mask"], seq["position_ids"], seq["response_mask"].shape[1],
                temperature=temperature, multi_modal=mm, modality=getattr(model, "postrl_modality", None),
            )  # fmt: skip
        for c, row in zip(part, logp.float().cpu().tolist()):
            mask = c.loss_mask or [1] * len(c.token_ids)
            c.logprobs = [x if m else 0.0 for x, m in zip(row[: len(c.token_ids)], mask)]


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
                        out.put(produced, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
    except _Stop:
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
    from postrl.guards import Guards

    cfg = spec.cfg
    guards = Guards(cfg, log=lambda msg: None)
    probe = spec.examples[0].prompt_ids if not spec.examples[0].multi_modal else None

    def versioned(engine, run):
        autocast = run.runtime.autocast

        def check(engine, model):  # the sync guard, on every version the worker loads
            return guards.check_sync(engine, model, probe, autocast()) if probe is not None else {}

        return VersionedEngine(engine, run.policy.model, weights, cfg.rollout, autocast(), stop, spec.parent, on_load=check,
                               logprobs=cfg.algorithm.rollout_correction.enable, share=share)  # fmt: skip

    run = build_run(cfg, "rollout-worker", examples=spec.examples, sampler_state=spec.sampler, prepare=weights.load, wrap=versioned)
    return run.engine, run.reward_fn, run.experience, run.sampler


# ------------------------------------------------------------------------------------ the trainer's


def split_stale(batch: Batch, step: int, max_staleness: int, group_size: int) -> tuple[Batch, int]:
    """The groups of `batch` whose every sequence is at most `max_staleness` versions behind `step`, and how
    many groups were dropped for being older."""
    groups = sum(o is None for o in batch.owners) // group_size  # rollout.agent's extra segments come after the groups
    fresh = [g for g in range(groups) if min(batch.versions[g * group_size : (g + 1) * group_size]) >= step - max_staleness]
    kept = select_groups(batch, fresh, group_size)
    if groups * group_size == batch.size:
        return kept, groups - len(fresh)
    new_row = {g * group_size + j: k * group_size + j for k, g in enumerate(fresh) for j in range(group_size)}
    extra = [i for i, o in enumerate(batch.owners) if o is not None and o in new_row]  # those of kept trajectories
    out = concat([kept, select(batch, extra)])
    out.owners = kept.owners + [new_row[batch.owners[i]] for i in extra]
    return out, groups - len(fresh)


class AsyncRollout:
    """The trainer's side of the worker: start it, take its batches, publish weights, restart it, stop it."""

    def __init__(self, cfg, model: torch.nn.Module, examples: list, sampler: dict, step: int, threads: int, log, lend: bool = False):
        """`threads`: this process's CPU threads, and the worker's; `lend`: the two lend them to each other
        while they wait (CoreShare; on CPU when the thread policy chose the count)."""
        self.cfg, self.examples, self.threads, self.log = cfg, examples, threads, log
        self.k = cfg.rollout.max_staleness
        self.G = cfg.rollout.n_samples_per_prompt
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.weights = SharedWeights(model, self.ctx)
        self.share = CoreShare(self.ctx, threads, lend)
        self.sums: dict[int, set[float]] = {}  # the checksums published as each version (two after a back-off)
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
        self.sums.setdefault(version, set()).add(self.weights.publish(model, version))
        for old in [v for v in self.sums if v < version - self.k - 1]:
            del self.sums[old]

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float], dict[str, float], dict]:
        """The batch of `step` (waits for it): the batch, its metrics, the worker's time split, the sampler
        position after it. Raises WorkerDied / UserError when the worker fails."""
        start = time.perf_counter()
        with self.share.waiting(TRAINER):  # a worker blocked on the full queue wakes up as this takes a batch
            while True:
                try:
                    got = self.queue.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if not self.proc.is_alive():
                        raise WorkerDied(f"the rollout worker exited with code {self.proc.exitcode} without a batch for step {step}")
        if isinstance(got, WorkerFailure):
            if got.user_error:
                raise UserError(*got.problems, title=got.title)
            raise WorkerDied(f"the rollout worker failed: {got.message}")
        assert got.index == step, f"the rollout worker sent batch {got.index} for step {step}"
        for version, value in got.checksums.items():  # the sync guard of the transport: every version
            if version in self.sums and value not in self.sums[version]:
                raise UserError(
                    f"the rollout worker sampled with weights of version {version} whose checksum ({value!r}) differs "
                    f"from what the trainer published ({sorted(self.sums[version])}): a weight update was missed or torn. "
                    "This is a bug in postrl's transport; please report it with the run's config."
                )
        batch, dropped = split_stale(got.batch, step, self.k, self.G)
        if dropped:  # cannot happen while the worker keeps its bound; counted, never trained on
            self.log(f"[yellow]async: dropped {dropped} group(s) older than rollout.max_staleness={self.k} at step {step}[/yellow]")
        stats = dict(got.stats)
        stats["async/dropped_stale_groups"] = float(dropped)
        stats["async/trainer_idle_s"] = time.perf_counter() - start
        stats["async/queue_depth"] = float(self.queue.qsize())
        stats.update(partial_metrics(batch))
        return batch, stats, got.seconds, got.sampler

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


class WorkerDied(Exception):
    """The rollout worker exited or raised (not a data error): the trainer restarts it or stops."""


def partial_metrics(batch: Batch) -> dict[str, float]:
    """async/partial_ratio: share of sequences sampled by more than one policy version (partial rollout)."""
    mixed = [len(set(v)) > 1 for v in batch.token_versions if v]
    return {"async/partial_ratio": sum(mixed) / len(mixed)} if mixed else {}
