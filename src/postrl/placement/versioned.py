"""The versioned engine of a rollout process (the worker's, a pool replica's): before each generation call it
loads the newest published weights, it stamps every completion with the version that sampled it, and the
sync guard checks the engine on every version loaded (`versioned`, the `wrap` of build_run's rollout-worker
role). Where the weights come from is the caller's: shared memory (worker.py) or a broadcast (replica.py)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from postrl.placement.cores import WORKER, CoreShare
from postrl.rollout import Completion, SamplingParams
from postrl.rollout.base import EngineWrapper

POLL_S = 1.0  # how often a waiting side looks at the other one (it wakes at once when there is news)


class StopRequested(Exception):
    """The trainer asked the rollout process to stop (or went away)."""


class NeverStop:
    """The stop event of a process the trainer stops by other means (a pool replica: Ray kills it)."""

    def is_set(self) -> bool:
        return False


def versioned(cfg: Any, examples: list, weights: Callable[[Any], Any], stop: Any, parent: int, share: Any = None) -> Callable:
    """build_run's `wrap` for the rollout-worker role: the engine versioned by `weights(run)` (what the
    published weights are read from), checked by the sync guard on every version it loads."""
    from postrl.guards import Guards

    guards = Guards(cfg, log=lambda msg: None)
    probe = examples[0].prompt_ids if not examples[0].multi_modal else None

    def wrap(engine, run):
        autocast = run.runtime.autocast

        def check(engine, model):  # the sync guard, on every version loaded
            return guards.check_sync(engine, model, probe, autocast()) if probe is not None else {}

        return VersionedEngine(engine, run.policy.model, weights(run), cfg.rollout, autocast(), stop, parent, on_load=check,
                               logprobs=cfg.algorithm.rollout_correction.enable, share=share)  # fmt: skip

    return wrap


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
                self.weights.wait_newer(version - 1, POLL_S)
        self.refresh()
        return time.perf_counter() - start

    def check_stop(self) -> None:
        if self.stop.is_set() or os.getppid() != self.parent:
            raise StopRequested

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

