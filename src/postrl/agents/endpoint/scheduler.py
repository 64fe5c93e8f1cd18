"""The engine thread: it admits agent programs, batches their requests into engine calls and enforces time limits.

`Scheduler.run` is called by `AgentGateway.generate` (agents/endpoint/gateway.py) on the thread that called it; that
thread is the only one that touches the engine, the tokenizer and the sessions' records. It collects the
programs' requests until every running program waits on one (or none came for `rollout.agent_batch_wait_ms`
or a tenth of an engine call, whichever is longer, and at most ten times that after the first), renders
them (agents/endpoint/jobs.py), and samples them in one engine call, so concurrent agents batch like the agent
loop's turns. With an engine that batches continuously (vLLM) that call is a continuous batch that each
request joins as it arrives (`Stream`), so the programs' HTTP work overlaps the engine's steps. There each
request samples with a seed of its own (`request_seed`: the rollout's seed, which sample, which of its
requests, which choice), never one that depends on when it arrived or what else was in the batch, so a seeded
rollout of deterministic programs samples the same tokens whatever the programs' timing (up to the float
rounding that a different batch composition may bring).

Every request gets an answer: sampled ids (agents/endpoint/answers.py), an OpenAI-shaped 400 (a prompt over the
run's context, a template that refuses the messages), 410 (its sample ended), or, should anything else
fail while handling that one request, a 500 for it alone (counted, `agent/internal_errors`); an engine
call that raises is a 500 for each of its requests. The loop goes on. Each trajectory has one token budget, `params.max_tokens`, across all its requests and segments.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

import postrl.agents.results as results
from postrl.agents.endpoint.answers import Shaper
from postrl.agents.endpoint.jobs import Job, prepare
from postrl.agents.endpoint.schema import BadRequest, error_body
from postrl.agents.endpoint.server import Pending, Tally
from postrl.agents.session import Session
from postrl.rollout.base import Completion, SamplingParams
from postrl.untrusted import AGENT_UNREADABLE

CLOSED = "this session is closed (its sample ended or ran out of time)"
STAT_KEYS = (
    "agent/errors", "agent/timeouts", "agent/internal_errors", "agent/requests", "agent/engine_calls", "agent/ticks",
    AGENT_UNREADABLE, "timing/agent_generate", "timing/agent_engine", "timing/agent_render", "timing/agent_idle",
)  # fmt: skip


@dataclass
class Rollout:
    """One `generate` call's programs: not started yet, running (session, deadline, thread or future), and the
    requests collected for the next engine call."""

    params: SamplingParams
    waiting: list[Session]
    running: dict[str, tuple[Session, float, Any]] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    calls: int = 0
    index: dict[str, int] = field(default_factory=dict)  # session key -> its sample's place (prompt-major)
    asked: dict[str, int] = field(default_factory=dict)  # session key -> its requests taken into a batch so far


class Scheduler:
    """The engine thread's loop for one gateway. `url_of(key)` is a session's base URL."""

    def __init__(
        self, engine: Any, cfg: Any, programs: Any, events: queue.Queue, shaper: Shaper, renderer: Any,
        refused: Tally, url_of: Callable[[str], str], log: Any = None, max_model_len: int | None = None,
    ):  # fmt: skip
        self.engine, self.cfg, self.programs, self.events, self.shaper = engine, cfg, programs, events, shaper
        self.renderer, self.tokenizer, self.refused, self.url_of, self.log = renderer, shaper.tokenizer, refused, url_of, log
        self.max_model_len = max_model_len  # prompt + sampled tokens the engine holds (vLLM's KV cache is sized for it)
        self.stats = dict.fromkeys(STAT_KEYS, 0.0)
        self.stuck: list[threading.Thread] = []  # sync programs past their time limit (Python cannot kill a thread)
        self.call_s = 0.0  # the engine calls' seconds, a running mean
        self.rendered: dict[str, list[int]] = {}  # whole chats' template ids (endpoint.prepare), per rollout

    def run(self, sessions: list[Session], params: SamplingParams) -> None:
        """Admit `sessions`' programs, batch their requests into engine calls, until every program has ended."""
        r = Rollout(params, list(sessions), index={s.key: i for i, s in enumerate(sessions)})
        continuous = self.engine.capabilities.continuous_batching
        try:
            while r.waiting or r.running:
                # waiting for stragglers costs little next to an engine call they would otherwise need of their own
                wait_s = max(self.cfg.agent_batch_wait_ms / 1000, 0.1 * self.call_s)
                self.admit(r)
                now = time.perf_counter()
                next_deadline = min(d for _, d, _ in r.running.values())
                starting = any(not x[0].asked for x in r.running.values())  # a program yet to send its first request
                flush_at = flush_time(r.pending, wait_s, starting) if r.pending else now + 0.5
                events = []
                try:
                    events.append(self.events.get(timeout=max(0.0, min(next_deadline, flush_at) - now)))
                    while True:
                        events.append(self.events.get_nowait())
                except queue.Empty:
                    pass
                self.stats["timing/agent_idle"] += time.perf_counter() - now
                self.take(r, events)
                waiting_on_us = len({p.session.key for p in r.pending})
                starting = any(not x[0].asked for x in r.running.values())
                # a continuous batch starts at the first request: the others join it as they come
                due = time.perf_counter() >= flush_time(r.pending, wait_s, starting) if r.pending else False
                if r.pending and (continuous or waiting_on_us >= len(r.running) or due):
                    batch, r.pending = r.pending, []
                    if continuous:
                        r.calls += Stream(self, r).run(batch)
                    else:  # one seed per call: an engine without continuous batching (hf) samples a batch with one RNG
                        seed = None if params.seed is None else (params.seed + 7919 * r.calls) % 2**31
                        r.calls += self.sample(batch, replace(params, seed=seed))
        finally:
            self.rendered.clear()

    def admit(self, r: Rollout) -> None:
        while r.waiting and len(r.running) < self.cfg.agent_concurrency:
            s = r.waiting.pop(0)
            handle = self.programs.launch(s, self.url_of(s.key), self.shaper.model_name)
            r.running[s.key] = (s, time.perf_counter() + self.cfg.agent_timeout_s, handle)

    def take(self, r: Rollout, events: list[tuple]) -> None:
        """New requests join `r.pending`, ended programs are scored, programs past their time limit are ended."""
        for kind, *what in events:
            if kind == "request":
                p = what[0]
                p.session.asked = True
                if p.session.key in r.running and not p.session.closed:
                    r.pending.append(p)
                else:
                    p.reply(410, error_body(CLOSED))
            elif kind == "done":
                s, outcome, value = what
                if s.key in r.running:
                    del r.running[s.key]
                    self.finish(s, outcome, value)
        now = time.perf_counter()
        for key, (s, deadline, handle) in list(r.running.items()):
            if now >= deadline:
                del r.running[key]
                self.finish(s, "timeout", None)
                if isinstance(handle, threading.Thread):
                    self.stuck.append(handle)
                elif handle is not None:
                    handle.cancel()
        for p in [p for p in r.pending if p.session.closed]:
            p.reply(410, error_body(CLOSED))
        r.pending = [p for p in r.pending if not p.session.closed]

    def finish(self, s: Session, outcome: str, value: Any) -> None:
        s.closed = True
        if outcome == "ok" and value is not None:  # the user's value: checked here, on the engine thread (agents/results.py)
            try:
                value = results.reward(value, "the agent's return")
            except results.BadResult as exc:
                outcome, value = "error", results.BadResult(f"{exc}, or None")
        if outcome == "ok" and s.main_segment() is None:
            outcome, value = "error", RuntimeError("the agent never called the model")
        s.outcome = outcome
        if outcome == "ok":
            s.reward = value
        elif outcome == "error":
            s.error = results.error_text(value)
            if self.log is not None and self.stats["agent/errors"] < 3:
                self.log(f"[yellow]rollout.agent raised on a sample (scored 0): {s.error[:300]}[/yellow]")
            self.stats["agent/errors"] += 1
        else:
            self.stats["agent/timeouts"] += 1

    # ------------------------------------------------------------------------ engine calls
    def prepare(self, batch: list[Pending], params: SamplingParams) -> list[tuple[Job, int, tuple[int, ...]]]:
        """Render the requests: (job, room, stop ids) of each one to sample; the others are answered here."""
        jobs = []
        start = time.perf_counter()
        for p in batch:
            with self.contained(p):
                job = self._job(p, params)
                if job is not None:
                    jobs.append(job)
        self.stats["timing/agent_render"] += time.perf_counter() - start
        return jobs

    def _job(self, p: Pending, params: SamplingParams) -> tuple[Job, int, tuple[int, ...]] | None:
        job = prepare(p, self.renderer, self.tokenizer, self.rendered)
        if self.max_model_len is not None and len(job.prompt) >= self.max_model_len:
            message = f"the prompt has {len(job.prompt)} tokens; this run's context is {self.max_model_len} (data.max_prompt_length + rollout.max_tokens)"
            raise BadRequest(message, "messages", code="context_length_exceeded")
        room = min(job.max_tokens or params.max_tokens, params.max_tokens - spent(p.session, job.prompt))
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(job.prompt))
        if room <= 0:  # the trajectory's budget is spent: nothing sampled, nothing recorded
            self.shaper.empty(job)
            return None
        stops = tuple(params.stop_token_ids) + ((self.shaper.call_end_id,) if job.tools and self.shaper.call_end_id is not None else ())
        return job, room, stops

    @contextlib.contextmanager
    def contained(self, p: Pending):
        """Whatever handling request `p` raises is `p`'s answer (its 4xx, or a 500), counted; never the loop's end."""
        try:
            yield
        except BadRequest as exc:
            self.refused.add()
            p.session.bad_requests += 1
            p.reply(exc.status, error_body(exc.message, exc.param, code=exc.code))
        except Exception as exc:
            self.refused.add()
            p.session.bad_requests += 1
            self.stats["agent/internal_errors"] += 1
            if self.log is not None and self.stats["agent/internal_errors"] <= 3:
                self.log(f"[yellow]the rollout endpoint failed on a request (answered 500): {type(exc).__name__}: {exc}[/yellow]")
            p.reply(500, error_body(f"the endpoint failed on this request: {type(exc).__name__}: {exc}"[:500], kind="server_error"))

    def engine_failed(self, exc: Exception, jobs: list[Job]) -> None:
        """The engine raised on a call: each of its requests is answered 500 (counted); the programs decide what
        next (a run whose programs all fail stops on that rule, with the error)."""
        if self.log is not None and self.stats["agent/internal_errors"] < 3:
            self.log(f"[yellow]the rollout engine failed on {len(jobs)} endpoint request(s) (answered 500): {type(exc).__name__}: {exc}[/yellow]")
        for job in jobs:
            with self.contained(job.pending):
                raise RuntimeError(f"the rollout engine failed: {type(exc).__name__}: {exc}")

    def answer(self, job: Job, room: int, outs: list[Completion], stops: set[int]) -> None:
        with self.contained(job.pending):
            self.shaper.answer(job, room, outs, stops, self.stats)

    def sample(self, batch: list[Pending], params: SamplingParams) -> int:
        """Render, sample and answer one batch of requests; returns the number of engine calls made."""
        groups: dict[tuple, list[tuple[Job, int]]] = {}
        for job, room, stops in self.prepare(batch, params):
            groups.setdefault((1 if params.greedy else job.n, stops), []).append((job, room))
        for (n, stops), group in groups.items():
            call = replace(params, n=n, max_tokens=max(r for _, r in group), stop_token_ids=stops)
            self.stats["agent/engine_calls"] += 1
            self.stats["agent/requests"] += len(group)
            start = time.perf_counter()
            try:
                outs = self.engine.generate([j.prompt for j, _ in group], call)
            except Exception as exc:  # the engine failed on these requests: theirs to answer, not the loop's end
                self.engine_failed(exc, [job for job, _ in group])
                continue
            seconds = time.perf_counter() - start
            self.call_s = 0.5 * self.call_s + 0.5 * seconds
            self.stats["timing/agent_engine"] += seconds
            for k, (job, room) in enumerate(group):
                mine = outs[k * n : (k + 1) * n] * (job.n if n == 1 and job.n > 1 else 1)
                self.answer(job, room, mine, set(stops))
        return len(groups)


class Stream:
    """One continuous batch (vLLM's `generate_continuing`): the first requests start it; after every engine step
    that finished a request, the finished requests are answered and the requests that arrived meanwhile join
    it, so the programs' HTTP round trips overlap the engine's steps instead of holding the batch at every
    turn. While requests run and some program is between requests, a one-token 'tick' request keeps an engine
    step from passing unpolled."""

    def __init__(self, scheduler: Scheduler, r: Rollout):
        self.s, self.r = scheduler, r
        self.one = replace(r.params, n=1, seed=None)  # each request's seed is its own (`request_seed`)
        self.live: dict[int, tuple[Job, int, tuple[int, ...], list[Completion | None]]] = {}
        self.ticking = False  # a tick request is in the batch
        self.polled_s = 0.0  # the seconds spent in `on_finish` (not the engine's)

    def run(self, batch: list[Pending]) -> int:
        """Returns when the engine has nothing left to run: 1 (one engine call), or 0 if nothing was to sample."""
        first = self.requests(self.s.prepare(self.ordered(batch), self.r.params))
        if not first:
            return 0
        first += self.tick()
        self.s.stats["agent/engine_calls"] += 1
        start = time.perf_counter()
        try:
            self.s.engine.generate_continuing(first, self.on_finish, seed=None)  # None: each request's own seed
        except Exception as exc:  # the requests still in the batch are answered 500; the loop goes on
            self.s.engine_failed(exc, [job for job, *_ in self.live.values()])
            self.live.clear()
        self.s.stats["timing/agent_engine"] += time.perf_counter() - start - self.polled_s
        return 1

    def ordered(self, batch: list[Pending]) -> list[Pending]:
        """`batch` in the samples' order (prompt-major), not the order the requests arrived in."""
        return sorted(batch, key=lambda p: self.r.index[p.session.key])

    def requests(self, prepared: list[tuple[Job, int, tuple[int, ...]]]) -> list[tuple[Any, list[int], SamplingParams]]:
        out, seed = [], self.r.params.seed
        for job, room, stops in prepared:
            k, n, key = id(job), 1 if self.r.params.greedy else job.n, job.pending.session.key
            self.live[k] = (job, room, stops, [None] * n)
            sample, nth = self.r.index[key], self.r.asked.get(key, 0)
            self.r.asked[key] = nth + 1
            out += [((k, i), job.prompt, replace(self.one, max_tokens=room, stop_token_ids=stops, seed=request_seed(seed, sample, nth, i)))
                    for i in range(n)]  # fmt: skip
        self.s.stats["agent/requests"] += len(prepared)
        return out

    def on_finish(self, done: list[tuple[Any, Completion]]) -> list[tuple[Any, list[int], SamplingParams]]:
        start = time.perf_counter()
        for key, out in done:
            if key is None:
                self.ticking = False
                continue
            job, room, stops, outs = self.live[key[0]]
            outs[key[1]] = out
            if all(o is not None for o in outs):
                del self.live[key[0]]
                self.s.answer(job, room, outs * (job.n if len(outs) == 1 else 1), set(stops))
        events = []
        with contextlib.suppress(queue.Empty):
            while True:
                events.append(self.s.events.get_nowait())
        self.s.take(self.r, events)
        self.s.admit(self.r)
        new, self.r.pending = self.requests(self.s.prepare(self.ordered(self.r.pending), self.r.params)), []
        self.polled_s += time.perf_counter() - start
        return new + self.tick()

    def tick(self) -> list[tuple[Any, list[int], SamplingParams]]:
        asking = {job.pending.session.key for job, *_ in self.live.values()}
        if not self.live or self.ticking or all(key in asking for key in self.r.running):
            return []
        self.ticking = True
        self.s.stats["agent/ticks"] += 1
        return [(None, [next(iter(self.s.shaper.eos_ids))], replace(self.one, max_tokens=1, stop_token_ids=()))]


def request_seed(seed: int | None, sample: int, request: int, choice: int) -> int | None:
    """The sampling seed of choice `choice` of the `request`-th request of sample `sample` in a rollout seeded
    `seed` (None: unseeded): a function of which request it is, not of when it came."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, sample, request, choice]).generate_state(1)[0] >> 1)


def spent(s: Session, prompt: list[int]) -> int:
    """Tokens of `s`'s trajectory after its first prompt, if `prompt` is its next request: every segment's
    sampled and rendered ids, plus what `prompt` adds to the segment it continues (the tool results, the
    next header), as the agent loop counts; a request that opens a new segment gets no fresh budget."""
    used = sum(len(seg.ids) for seg in s.segments)
    target = next((c for c in s.tips if prompt[: len(c.full)] == c.full), None)
    return used + (len(prompt) - len(target.full) if target is not None else 0)


def flush_time(pending: list[Pending], wait_s: float, starting: bool) -> float:
    """When to sample the requests collected so far if not every program waits on one: `wait_s` after the
    last arrived (requests that keep coming keep the batch open), and at most max(10 x `wait_s`, 1 s) after
    the first; while some program has not sent its first request yet (it is on its way: every program calls
    the model), not before that cap, and later while first requests keep coming (192 programs starting on a
    loaded CPU take longer than the cap, and a first turn cut in two costs a whole engine call)."""
    cap = pending[0].arrived + max(10 * wait_s, 1.0)
    return max(cap, pending[-1].arrived + wait_s) if starting else min(pending[-1].arrived + wait_s, cap)
