"""Any agent program as a rollout: an OpenAI-compatible endpoint that records the tokens it samples.

`rollout.agent: my_pkg.agent:run` names a function, sync or async, that postrl calls once per rollout
sample with an `openai` client already pointed at that sample's session and the sample's dataset row:

    def run(client: openai.OpenAI, row: dict) -> float | None:      # or async def, with AsyncOpenAI
        ...client.chat.completions.create(model=client.model, messages=..., tools=...)...
        return reward          # or None: reward.verifiers score what the model wrote

`AgentGateway` is a rollout engine (rollout/base.py's protocol) around the real one, like the agent
loop, so training, validation, `postrl eval` and `postrl doctor` all roll out through it. The
gateway is the engine wrapper only; its jobs live in modules of their own:

- agents/endpoint/server.py: the HTTP side (uvicorn, started once on `rollout.agent_host`, loopback unless
  `rollout.agent_allow_remote`), what it refuses before any work (connections, header and body time,
  body size, unknown sessions), and agents/endpoint/schema.py: bodies parsed into declared models of
  OpenAI's schema and checked against the run's limits;
- agents/endpoint/scheduler.py: the engine thread (the one that calls `generate`): programs admitted (up to
  `rollout.agent_concurrency` at once, each under `rollout.agent_timeout_s`; threads for sync functions,
  an event loop for async ones, or `rollout.agent_workers` worker processes: agents/programs/programs.py,
  agents/programs/workers.py), their requests batched into engine calls or joined to a continuous batch;
- agents/endpoint/jobs.py: a request as engine work (the prompt ids); agents/endpoint/answers.py: sampled ids as the
  session's record and the OpenAI response.

Each session's requests become segments (agents/session.py, DESIGN.md section 12); the completion of
a sample is its main segment (the one its last request extended), and its other segments ride along
in `Completion.segments`. A program that raises, overruns its time, returns something that is not a
number, or never calls the model scores 0 and trains nothing (loss mask all 0); each outcome is
counted (`agent/errors`, `agent/timeouts`, `agent/bad_requests`, `agent/internal_errors`), never fatal.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from postrl.agents.endpoint.answers import Shaper
from postrl.agents.endpoint.schema import Limits
from postrl.agents.programs.workers import WorkerPool
from postrl.agents.programs.programs import Programs, load_agent
from postrl.agents.loop.render import TurnRenderer
from postrl.agents.endpoint.scheduler import Scheduler
from postrl.agents.endpoint.server import Gate, HttpLimits, Server, Tally, make_app
from postrl.agents.session import Session
from postrl.errors import UserError
from postrl.rollout.base import Completion, EngineWrapper, SamplingParams
from postrl.turns import end_ids

if TYPE_CHECKING:
    from postrl.config import RolloutConfig

logger = logging.getLogger("postrl")


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
        events: queue.Queue = queue.Queue()  # the server's requests and the programs' ends, for the engine thread
        super().__init__(engine)  # what the wrapped engine can do is what the gateway can, but for continuous
        self.capabilities = replace(engine.capabilities, continuous_batching=False)  # batching: requests go through it
        self.tokenizer, self.cfg, self.log, self._events = tokenizer, cfg, log, events
        if agent is None and cfg.agent_workers > 0:  # only a spec can go to worker processes
            self.programs: Any = WorkerPool(cfg.agent, cfg.agent_workers, cfg, events)
        else:
            self.programs = Programs(agent if agent is not None else load_agent(cfg.agent), cfg, events)
        self.agent, self.is_async = self.programs.agent, self.programs.is_async
        self.eos_ids, call_end_id = end_ids(model, tokenizer)
        self.model_name = str(tokenizer.name_or_path or "postrl-policy")
        self.shaper = Shaper(tokenizer, frozenset(self.eos_ids), call_end_id, self.model_name)
        self.refused = Tally()  # requests refused (4xx, 5xx), by the server's thread and the engine thread
        self.scheduler = Scheduler(engine, cfg, self.programs, events, self.shaper, TurnRenderer(tokenizer), self.refused,
                                   self.url, log=log, max_model_len=max_model_len)  # fmt: skip
        self._sessions: dict[str, Session] = {}
        self._server: Server | None = None
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

    def submit(self, pending: Any) -> None:  # the server's thread
        self._events.put(("request", pending))

    def url(self, key: str) -> str:
        self._start()
        return self._server.url(key)

    def _start(self) -> None:
        if self._server is not None:
            return
        cfg, http = self.cfg, HttpLimits.of(self.cfg)
        gate = Gate(http, self.refused)
        self._server = Server(make_app(self, Limits.of(cfg, self.scheduler.max_model_len, self.tokenizer), http, self.refused, gate), host=cfg.agent_host, port=cfg.agent_port, gate=gate)
        where = f"http://{cfg.agent_host}:{self._server.port}/s/<session>/v1"
        if cfg.agent_allow_remote:
            warning = (f"the rollout endpoint serves on {cfg.agent_host} (rollout.agent_allow_remote): whoever reaches that "
                       "address and knows a session key samples from the policy")  # fmt: skip
            logger.warning(warning)
            if self.log is not None:
                self.log(f"[yellow]{warning}[/yellow]")
        if self.log is not None:
            self.log(f"rollout endpoint: {where} (OpenAI-compatible)")

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
            self.scheduler.run(sessions, params)
        finally:
            for s in sessions:
                s.closed = True
                self._sessions.pop(s.key, None)
            self.programs.reap()  # worker processes holding programs past their time limit are replaced
        self.scheduler.stats["timing/agent_generate"] += time.perf_counter() - start
        out = [self._completion(s, prompts[s.prompt_index]) for s in sessions]
        self._record(sessions, out)
        return out

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
        c.tool_calls = s.tool_calls
        c.env_reward = s.reward or 0.0
        others = [seg.completion(s.prompt_index) for seg in s.segments if seg is not main]
        c.segments = others or None
        return c

    # ------------------------------------------------------------------------------ metrics
    def reset_stats(self) -> None:
        self.scheduler.stats = {k: 0.0 for k in self.scheduler.stats}
        self._n = self._turns = self._calls = self._with_call = self._model = self._total = self._segments = 0
        self._reward = 0.0

    def _record(self, sessions: list[Session], out: list[Completion]) -> None:
        self._n += len(sessions)
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
        m = {**self.scheduler.stats, "agent/bad_requests": float(self.refused.pop())}
        m["agent/requests_mean"] = m.pop("agent/requests") / n
        m["agent/batch_mean"] = m["agent/requests_mean"] * n / max(m["agent/engine_calls"], 1)
        m.update({
            "agent/turns_mean": self._turns / n, "agent/tool_calls_mean": self._calls / n,
            "agent/tool_call_ratio": self._with_call / n, "agent/model_tokens_mean": self._model / n,
            "agent/total_tokens_mean": self._total / n, "agent/segments_mean": self._segments / n,
            "agent/reward_mean": self._reward / n, "agent/stuck_threads": float(sum(t.is_alive() for t in self.scheduler.stuck)),
        })  # fmt: skip
        self.scheduler.stuck = [t for t in self.scheduler.stuck if t.is_alive()]
        self.reset_stats()
        return m
