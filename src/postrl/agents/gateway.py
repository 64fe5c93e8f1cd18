"""Any agent program as a rollout: an OpenAI-compatible endpoint that records the tokens it samples.

`rollout.agent: my_pkg.agent:run` names a function, sync or async, that postrl calls once per rollout
sample with an `openai` client already pointed at that sample's session and the sample's dataset row:

    def run(client: openai.OpenAI, row: dict) -> float | None:      # or async def, with AsyncOpenAI
        ...client.chat.completions.create(model=client.model, messages=..., tools=...)...
        return reward          # or None: reward.verifiers score what the model wrote

`AgentGateway` is a rollout engine (rollout/base.py's protocol) around the real one, like the agent
loop, so training, validation, `postrl eval` and `postrl doctor` all roll out through it. Per
`generate` call: the endpoint (agents/endpoint.py) is started once on loopback; every sample gets a
session; up to `rollout.agent_concurrency` programs run at once (threads for sync functions, an event
loop for async ones; in `rollout.agent_workers` worker processes if set, agents/program_workers.py),
each under `rollout.agent_timeout_s`. The calling thread is the engine thread:
it collects the programs' requests until every running program waits on one (or none came for
`rollout.agent_batch_wait_ms` or a tenth of an engine call, whichever is longer, and at most ten times
that after the first), renders them, and samples them in one engine call, so concurrent
agents batch like the agent loop's turns. With an engine that batches continuously (vLLM) that call
is a continuous batch that each request joins as it arrives (`_stream`), so the programs' HTTP work
overlaps the engine's steps. The engine is only ever used from that thread. Each running program has
an HTTP client of its own (agents/programs.py).

Each session's requests become segments (agents/session.py, DESIGN.md section 12); the completion of
a sample is its main segment (the one its last request extended), and its other segments ride along
in `Completion.segments`. A program that raises, overruns its time, returns something that is not a
number, or never calls the model scores 0 and trains nothing (loss mask all 0); each outcome is
counted (`agent/errors`, `agent/timeouts`, `agent/bad_requests`), never fatal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from postrl.agents.endpoint import BadRequest, Job, Pending, Server, cut_at_stop, error_body, make_app, prepare, respond
from postrl.agents.program_workers import WorkerPool
from postrl.agents.programs import Programs, load_agent
from postrl.agents.render import TurnRenderer
from postrl.agents.session import Session
from postrl.errors import UserError
from postrl.rollout.base import Completion, EngineWrapper, SamplingParams, eos_token_ids

if TYPE_CHECKING:
    from postrl.config import RolloutConfig


@dataclass
class _Rollout:
    """One `generate` call's programs: not started yet, running (session, deadline, thread or future), and the
    requests collected for the next engine call."""

    params: SamplingParams
    waiting: list[Session]
    running: dict[str, tuple[Session, float, Any]] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    calls: int = 0


class AgentGateway(EngineWrapper):
    """A rollout engine whose trajectories are what a user's agent program did through the endpoint. Its
    `generate` also takes the prompts' dataset `rows` (every program gets its sample's row)."""

    def __init__(
        self, engine: Any, tokenizer: Any, cfg: "RolloutConfig", model: Any = None, log: Any = None, agent: Any = None,
        max_model_len: int | None = None,
    ):  # fmt: skip
        missing = [m for m in ("fastapi", "uvicorn", "openai", "httpx") if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(
                f"rollout.agent runs the program through an OpenAI-compatible endpoint, which needs {', '.join(missing)} "
                "(not installed). Fix: pip install 'postrl[agent]' (vLLM installs them too)."
            )
        self._events: queue.Queue = queue.Queue()  # the server's requests and the programs' ends, for the engine thread
        super().__init__(engine)  # what the wrapped engine can do is what the gateway can, but for continuous
        self.capabilities = replace(engine.capabilities, continuous_batching=False)  # batching: requests go through it
        self.tokenizer, self.cfg, self.log = tokenizer, cfg, log
        self.max_model_len = max_model_len  # prompt + sampled tokens the engine holds (vLLM's KV cache is sized for it)
        if agent is None and cfg.agent_workers > 0:  # only a spec can go to worker processes
            self.programs: Any = WorkerPool(cfg.agent, cfg.agent_workers, cfg, self._events)
        else:
            self.programs = Programs(agent if agent is not None else load_agent(cfg.agent), cfg, self._events)
        self.agent, self.is_async = self.programs.agent, self.programs.is_async
        self.renderer = TurnRenderer(tokenizer)
        self.eos_ids = set(eos_token_ids(model, tokenizer)) if model is not None else {tokenizer.eos_token_id}
        end = tokenizer.convert_tokens_to_ids("</tool_call>")
        self.call_end_id = end if isinstance(end, int) and end != tokenizer.unk_token_id else None
        self.model_name = str(getattr(tokenizer, "name_or_path", "") or "postrl-policy")
        self._sessions: dict[str, Session] = {}
        self._server: Server | None = None
        self._stuck: list[threading.Thread] = []
        self._call_s = 0.0  # the engine calls' seconds, a running mean
        self._rendered: dict[str, list[int]] = {}  # whole chats' template ids (endpoint.prepare)
        self.reset_stats()

    # ------------------------------------------------------------------ the engine protocol
    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.programs.close()
        self.engine.close()

    # ------------------------------------------------------------------ the endpoint's hub
    def session(self, key: str) -> Session | None:
        return self._sessions.get(key)

    def submit(self, pending: Pending) -> None:  # the server's thread
        self._events.put(("request", pending))

    def url(self, key: str) -> str:
        self._start()
        return self._server.url(key)

    def _start(self) -> None:
        if self._server is None:
            host = getattr(self.cfg, "agent_host", "127.0.0.1")
            self._server = Server(make_app(self), host=host, port=getattr(self.cfg, "agent_port", 0))
            if self.log is not None:
                self.log(f"rollout endpoint: http://{host}:{self._server.port}/s/<session>/v1 (OpenAI-compatible)")

    # ------------------------------------------------------------------------- a rollout
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, multi_modal: list[dict] | None = None,
        rows: list[dict] | None = None,
    ) -> list[Completion]:  # fmt: skip
        """`params.n` samples per prompt, prompt-major; each is one run of the program with its prompt's row.
        `params.max_tokens` is each trajectory's budget across its requests."""
        if multi_modal is not None and any(multi_modal):
            raise UserError("rollout.agent runs text programs; this dataset has images. Fix: use a text dataset with rollout.agent.")
        self._start()
        n = 1 if params.greedy else params.n
        rows = rows if rows is not None else [{} for _ in prompts]
        sessions = [Session(uuid.uuid4().hex, i, rows[i]) for i in range(len(prompts)) for _ in range(n)]
        for s in sessions:
            self._sessions[s.key] = s
        start = time.perf_counter()
        try:
            self._serve(sessions, params)
        finally:
            for s in sessions:
                s.closed = True
                self._sessions.pop(s.key, None)
            self.programs.reap()  # worker processes holding programs past their time limit are replaced
        self.stats["timing/agent_generate"] += time.perf_counter() - start
        out = [self._completion(s, prompts[s.prompt_index]) for s in sessions]
        self._record(sessions, out)
        return out

    def _serve(self, sessions: list[Session], params: SamplingParams) -> None:
        """The engine thread: admit programs, batch their requests into engine calls, enforce time limits."""
        r = _Rollout(params, list(sessions))
        continuous = self.engine.capabilities.continuous_batching
        while r.waiting or r.running:
            # waiting for stragglers costs little next to an engine call they would otherwise need of their own
            wait_s = max(self.cfg.agent_batch_wait_ms / 1000, 0.1 * self._call_s)
            self._admit(r)
            now = time.perf_counter()
            next_deadline = min(d for _, d, _ in r.running.values())
            starting = any(not x[0].asked for x in r.running.values())  # a program yet to send its first request
            flush_at = self._flush_at(r.pending, wait_s, starting) if r.pending else now + 0.5
            events = []
            try:
                events.append(self._events.get(timeout=max(0.0, min(next_deadline, flush_at) - now)))
                while True:
                    events.append(self._events.get_nowait())
            except queue.Empty:
                pass
            self.stats["timing/agent_idle"] += time.perf_counter() - now
            self._take(r, events)
            waiting_on_us = len({p.session.key for p in r.pending})
            starting = any(not x[0].asked for x in r.running.values())
            # a continuous batch starts at the first request: the others join it as they come
            if r.pending and (continuous or waiting_on_us >= len(r.running) or time.perf_counter() >= self._flush_at(r.pending, wait_s, starting)):
                batch, r.pending = r.pending, []
                seed = None if params.seed is None else (params.seed + 7919 * r.calls) % 2**31
                r.calls += self._stream(batch, r, seed) if continuous else self._sample(batch, replace(params, seed=seed))

    def _admit(self, r: "_Rollout") -> None:
        while r.waiting and len(r.running) < self.cfg.agent_concurrency:
            s = r.waiting.pop(0)
            r.running[s.key] = (s, time.perf_counter() + self.cfg.agent_timeout_s, self.programs.launch(s, self._server.url(s.key), self.model_name))

    def _take(self, r: "_Rollout", events: list[tuple]) -> None:
        """New requests join `r.pending`, ended programs are scored, programs past their time limit are ended."""
        closed = "this session is closed (its sample ended or ran out of time)"
        for kind, *what in events:
            if kind == "request":
                p = what[0]
                p.session.asked = True
                if p.session.key in r.running and not p.session.closed:
                    r.pending.append(p)
                else:
                    p.reply(410, error_body(closed))
            elif kind == "done":
                s, outcome, value = what
                if s.key in r.running:
                    del r.running[s.key]
                    self._finish(s, outcome, value)
        now = time.perf_counter()
        for key, (s, deadline, handle) in list(r.running.items()):
            if now >= deadline:
                del r.running[key]
                self._finish(s, "timeout", None)
                if isinstance(handle, threading.Thread):
                    self._stuck.append(handle)
                elif handle is not None:
                    handle.cancel()
        for p in [p for p in r.pending if p.session.closed]:
            p.reply(410, error_body(closed))
        r.pending = [p for p in r.pending if not p.session.closed]

    @staticmethod
    def _flush_at(pending: list[Pending], wait_s: float, starting: bool) -> float:
        """When to sample the requests collected so far if not every program waits on one: `wait_s` after the
        last arrived (requests that keep coming keep the batch open), and at most max(10 x `wait_s`, 1 s) after
        the first; while some program has not sent its first request yet (it is on its way: every program calls
        the model), not before that cap, and later while first requests keep coming (192 programs starting on a
        loaded CPU take longer than the cap, and a first turn cut in two costs a whole engine call)."""
        cap = pending[0].arrived + max(10 * wait_s, 1.0)
        return max(cap, pending[-1].arrived + wait_s) if starting else min(pending[-1].arrived + wait_s, cap)

    def _finish(self, s: Session, outcome: str, value: Any) -> None:
        s.closed = True
        if outcome == "ok" and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            outcome, value = "error", TypeError(f"the agent returned {type(value).__name__} {value!r:.60}; it must return a number or None")
        if outcome == "ok" and s.main_segment() is None:
            outcome, value = "error", RuntimeError("the agent never called the model")
        s.outcome = outcome
        if outcome == "ok":
            s.reward = None if value is None else float(value)
        elif outcome == "error":
            s.error = f"{type(value).__name__}: {value}"
            if self.log is not None and self.stats["agent/errors"] < 3:
                self.log(f"[yellow]rollout.agent raised on a sample (scored 0): {s.error[:300]}[/yellow]")
            self.stats["agent/errors"] += 1
        else:
            self.stats["agent/timeouts"] += 1

    # ------------------------------------------------------------------------ engine calls
    def _prepare(self, batch: list[Pending], params: SamplingParams) -> list[tuple[Job, int, tuple[int, ...]]]:
        """Render the requests: (job, room, stop ids) of each one to sample; the others are answered here."""
        jobs = []
        start = time.perf_counter()
        for p in batch:
            try:
                job = prepare(p, self.renderer, self.tokenizer, self._rendered)
            except BadRequest as exc:
                p.session.bad_requests += 1
                p.reply(exc.status, error_body(exc.message, exc.param))
                continue
            target = next((c for c in p.session.tips if job.prompt[: len(c.full)] == c.full), None)
            used = len(job.prompt) - len(target.segment.prompt) if target is not None else 0
            room = min(job.max_tokens or params.max_tokens, params.max_tokens - used)
            if self.max_model_len is not None and len(job.prompt) >= self.max_model_len:
                p.session.bad_requests += 1
                message = f"the prompt has {len(job.prompt)} tokens; this run's context is {self.max_model_len} (data.max_prompt_length + rollout.max_tokens)"
                p.reply(400, error_body(message, "messages", code="context_length_exceeded"))
                continue
            if self.max_model_len is not None:
                room = min(room, self.max_model_len - len(job.prompt))
            if room <= 0:  # the trajectory's budget is spent: nothing sampled, nothing recorded
                p.reply(200, respond(job, [([], [], "length")] * job.n, self.tokenizer, self.eos_ids, self.model_name))
                continue
            stops = tuple(params.stop_token_ids) + ((self.call_end_id,) if job.tools and self.call_end_id is not None else ())
            jobs.append((job, room, stops))
        self.stats["timing/agent_render"] += time.perf_counter() - start
        return jobs

    def _sample(self, batch: list[Pending], params: SamplingParams) -> int:
        """Render, sample and answer one batch of requests; returns the number of engine calls made."""
        groups: dict[tuple, list[tuple[Job, int]]] = {}
        for job, room, stops in self._prepare(batch, params):
            groups.setdefault((1 if params.greedy else job.n, stops), []).append((job, room))
        for (n, stops), group in groups.items():
            call = replace(params, n=n, max_tokens=max(r for _, r in group), stop_token_ids=stops)
            self.stats["agent/engine_calls"] += 1
            self.stats["agent/requests"] += len(group)
            start = time.perf_counter()
            outs = self.engine.generate([j.prompt for j, _ in group], call)
            seconds = time.perf_counter() - start
            self._call_s = 0.5 * self._call_s + 0.5 * seconds
            self.stats["timing/agent_engine"] += seconds
            for k, (job, room) in enumerate(group):
                mine = outs[k * n : (k + 1) * n] * (job.n if n == 1 and job.n > 1 else 1)
                self._answer(job, room, mine, set(stops))
        return len(groups)

    def _stream(self, batch: list[Pending], r: "_Rollout", seed: int | None) -> int:
        """A continuous batch (vLLM): `batch` starts it; after every engine step that finished a request, the
        finished requests are answered and the requests that arrived meanwhile join it, so the programs' HTTP
        round trips overlap the engine's steps instead of holding the batch at every turn. While requests
        run and some program is between requests, a one-token 'tick' request keeps an engine step from
        passing unpolled. Returns when the engine has nothing left to run (1: one engine call)."""
        params, live, tick = r.params, {}, [False]
        one = replace(r.params, n=1, seed=None)

        def requests(prepared: list[tuple[Job, int, tuple[int, ...]]]) -> list[tuple[Any, list[int], SamplingParams]]:
            out = []
            for job, room, stops in prepared:
                k, n = id(job), 1 if params.greedy else job.n
                live[k] = (job, room, stops, [None] * n)
                out += [((k, i), job.prompt, replace(one, max_tokens=room, stop_token_ids=stops)) for i in range(n)]
            self.stats["agent/requests"] += len(prepared)
            return out

        def on_finish(done: list[tuple[Any, Completion]]) -> list[tuple[Any, list[int], SamplingParams]]:
            start = time.perf_counter()
            for key, out in done:
                if key is None:
                    tick[0] = False
                    continue
                job, room, stops, outs = live[key[0]]
                outs[key[1]] = out
                if all(o is not None for o in outs):
                    del live[key[0]]
                    self._answer(job, room, outs * (job.n if len(outs) == 1 else 1), set(stops))
            events = []
            with contextlib.suppress(queue.Empty):
                while True:
                    events.append(self._events.get_nowait())
            self._take(r, events)
            self._admit(r)
            new, r.pending = requests(self._prepare(r.pending, params)), []
            polled[0] += time.perf_counter() - start
            return new + ticked()

        def ticked() -> list[tuple[Any, list[int], SamplingParams]]:
            asking = {job.pending.session.key for job, *_ in live.values()}
            if not live or tick[0] or all(key in asking for key in r.running):
                return []
            tick[0] = True
            self.stats["agent/ticks"] += 1
            return [(None, [next(iter(self.eos_ids))], replace(one, max_tokens=1, stop_token_ids=()))]

        polled = [0.0]
        first = requests(self._prepare(batch, params))
        if not first:
            return 0
        first += ticked()
        self.stats["agent/engine_calls"] += 1
        start = time.perf_counter()
        self.engine.generate_continuing(first, on_finish, seed=seed)
        self.stats["timing/agent_engine"] += time.perf_counter() - start - polled[0]
        return 1

    def _answer(self, job: Job, room: int, outs: list[Completion], stops: set[int]) -> None:
        s = job.pending.session
        choices, finishes = [], []
        for out in outs:
            ids, lps = list(out.token_ids), out.logprobs
            finish = "stop" if ids and (ids[-1] in self.eos_ids or ids[-1] in stops) and len(ids) <= room else "length"
            ids = ids[:room]
            if job.stop:
                ids, hit = cut_at_stop(self.tokenizer, ids, job.stop)
                finish = "stop" if hit else finish
            lps = None if lps is None else list(lps[: len(ids)])
            finished = finish == "stop" and not (ids and ids[-1] == self.call_end_id)
            choices.append((ids, lps, finished))
            finishes.append(finish)
        tips = s.record(job.prompt, choices, outs[0].version if outs else None)
        body = respond(job, [(c[0], c[1], f) for c, f in zip(choices, finishes)], self.tokenizer, self.eos_ids, self.model_name)
        if job.messages is not None:
            for tip, choice in zip(tips, body["choices"]):
                tip.message = choice["message"]
            s.last_messages, s.last_tools = job.messages, job.tools
        else:
            s.last_messages = None
        s.tool_calls = len(s.tool_names)
        job.pending.reply(200, body)

    # ------------------------------------------------------------------------- results
    def _completion(self, s: Session, prompt: list[int]) -> Completion:
        main = s.main_segment()
        if s.outcome != "ok" or main is None:  # scored 0, trains nothing: the loss mask is all 0
            if main is None:
                eos = next(iter(self.eos_ids))
                return Completion(s.prompt_index, [eos], False, [0.0], loss_mask=[0], turn_spans=[])
            c = main.completion(s.prompt_index)
            return replace(c, loss_mask=[0] * len(c.token_ids), logprobs=None if c.logprobs is None else [0.0] * len(c.token_ids), turn_spans=[])
        c = main.completion(s.prompt_index)
        c.tool_calls = getattr(s, "tool_calls", 0)
        c.env_reward = s.reward or 0.0
        others = [seg.completion(s.prompt_index) for seg in s.segments if seg is not main]
        c.segments = others or None
        return c

    # ------------------------------------------------------------------------------ metrics
    def reset_stats(self) -> None:
        keys = ("agent/errors", "agent/timeouts", "agent/bad_requests", "agent/requests", "agent/engine_calls", "timing/agent_generate",
                "timing/agent_engine", "timing/agent_render", "timing/agent_idle", "agent/ticks")
        self.stats = {k: 0.0 for k in keys}
        self._n = self._turns = self._calls = self._with_call = self._model = self._total = self._segments = 0
        self._reward = 0.0

    def _record(self, sessions: list[Session], out: list[Completion]) -> None:
        self._n += len(sessions)
        self.stats["agent/bad_requests"] += sum(s.bad_requests for s in sessions)
        self._segments += sum(len(s.segments) for s in sessions)
        for c in out:
            self._turns += len(c.turn_spans or [])
            self._calls += c.tool_calls
            self._with_call += c.tool_calls > 0
            self._model += sum(c.loss_mask or [])
            self._total += len(c.token_ids)
            self._reward += c.env_reward

    def pop_metrics(self) -> dict[str, float]:
        """agent/* and timing/agent_generate since the last call (then reset)."""
        n = max(self._n, 1)
        m = dict(self.stats)
        m["agent/requests_mean"] = m.pop("agent/requests") / n
        m["agent/batch_mean"] = m["agent/requests_mean"] * n / max(m["agent/engine_calls"], 1)
        m.update({
            "agent/turns_mean": self._turns / n, "agent/tool_calls_mean": self._calls / n,
            "agent/tool_call_ratio": self._with_call / n, "agent/model_tokens_mean": self._model / n,
            "agent/total_tokens_mean": self._total / n, "agent/segments_mean": self._segments / n,
            "agent/reward_mean": self._reward / n, "agent/stuck_threads": float(sum(t.is_alive() for t in self._stuck)),
        })  # fmt: skip
        self._stuck = [t for t in self._stuck if t.is_alive()]
        self.reset_stats()
        return m
