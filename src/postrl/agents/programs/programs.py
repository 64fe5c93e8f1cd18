"""The users' agent programs of `rollout.agent`: loaded by name, run one per sample against the endpoint.

A sync function runs on a thread of its own, an async one as a task on one event loop; each gets an
`openai` client pointed at its sample's session. The gateway (agents/endpoint/gateway.py) launches them and
hears of their end on its event queue as ("done", session, "ok" | "error", value).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import queue
import threading
from pathlib import Path
from typing import Any

from postrl.agents.session import Session
from postrl.errors import UserError, fails_nearly_always
from postrl.utils import import_named, load_file_module, split_named


def load_agent(spec: str) -> Any:
    """The function named 'package.module:function' or 'path/to/file.py:function'."""
    module_name, attr = split_named(spec, f"rollout.agent '{spec}' is not of the form 'package.module:function' (or "
                                    "'path/to/file.py:function'). Fix: name a function (sync or async) that takes (client, row).")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UserError(f"rollout.agent '{spec}': the file {path} does not exist. Fix: give a path to your agent's file.")
        try:
            module = load_file_module(path, "postrl_user_agent_")
        except ValueError as exc:
            raise UserError(f"rollout.agent '{spec}': {exc}. Fix the file.") from None
        fn = getattr(module, attr, None)
    else:
        try:
            fn = import_named(spec, f"rollout.agent '{spec}'")
        except ValueError as exc:
            raise UserError(str(exc)) from None
    if not callable(fn):
        raise UserError(f"rollout.agent '{spec}' names no function in that module. Fix: name a function that takes (client, row).")
    return fn


class Programs:
    """Runs the agent function `agent` (sync or async) once per session."""

    def __init__(self, agent: Any, cfg: Any, events: queue.Queue, check: bool = True):
        self.agent, self.cfg, self._events = agent, cfg, events
        self.launched: list[Session] | None = [] if check else None  # this rollout's programs, for `check_outcomes`
        self.is_async = inspect.iscoroutinefunction(agent)
        self._loop: asyncio.AbstractEventLoop | None = None  # async programs run here
        self._free: dict[bool, list] = {False: [], True: []}  # idle httpx clients (sync, async)
        self._ssl: Any = None

    def launch(self, s: Session, url: str, model_name: str) -> Any:
        """Start one program: a thread (sync) or a task on the agents' loop (async); returns its handle. Each
        running program has an httpx client of its own (one kept-alive connection), taken from a free list
        and put back when the program ends: never shared by programs running at once, because httpcore's
        pool can close a connection it has just handed to another thread's request (encode/httpcore#1110,
        keep-alive expiry or surplus idle connections), which hung that request until agent_timeout_s."""
        import openai

        timeout = self.cfg.agent_timeout_s
        row, events, agent = s.row, self._events, self.agent
        if self.launched is not None:
            self.launched.append(s)
        if self.is_async:

            async def run_async() -> None:
                http = self._http_client(True)
                client = openai.AsyncOpenAI(base_url=url, api_key=s.key, max_retries=0, timeout=timeout, http_client=http)
                client.model = model_name
                try:
                    events.put(("done", s, "ok", await agent(client, row)))
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - whatever the user's program raised
                    events.put(("done", s, "error", exc))
                self._free[True].append(http)  # not on cancellation: its connection may be mid-request

            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="postrl-agents", daemon=True).start()
            return asyncio.run_coroutine_threadsafe(run_async(), self._loop)

        def run_sync() -> None:
            http = self._http_client(False)
            client = openai.OpenAI(base_url=url, api_key=s.key, max_retries=0, timeout=timeout, http_client=http)
            client.model = model_name
            try:
                events.put(("done", s, "ok", agent(client, row)))
            except BaseException as exc:  # noqa: BLE001 - whatever the user's program raised
                events.put(("done", s, "error", exc))
            self._free[False].append(http)  # the program returned: its requests are over

        t = threading.Thread(target=run_sync, name=f"postrl-agent-{s.key[:8]}", daemon=True)
        t.start()
        return t

    def _http_client(self, is_async: bool) -> Any:
        """A free httpx client, or a new one (one SSL context for all: making one per client costs ~40 ms)."""
        import ssl

        import httpx

        try:
            return self._free[is_async].pop()  # list.pop is atomic: the free list needs no lock
        except IndexError:
            pass
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        kind = httpx.AsyncClient if is_async else httpx.Client
        return kind(timeout=self.cfg.agent_timeout_s, verify=self._ssl, limits=httpx.Limits(max_connections=4, max_keepalive_connections=1))

    def reap(self) -> None:
        """The end of a rollout: `check_outcomes` (a stuck thread cannot be killed; the gateway counts it)."""
        if self.launched is not None:
            launched, self.launched = self.launched, []
            check_outcomes(launched, self.cfg)

    def close(self) -> None:
        if self._loop is not None:
            clients, self._free[True] = self._free[True], []

            async def close_async() -> None:
                for c in clients:
                    await c.aclose()

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_async(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        while self._free[False]:
            self._free[False].pop().close()


def check_outcomes(sessions: list[Session], cfg: Any) -> None:
    """Stop the run when (nearly) every program of one rollout failed: raised, ran past its time limit, returned
    no number, or never called the model (the gateway's outcomes, agents/endpoint/gateway.py `_finish`). Each such sample
    scores 0 and trains nothing, so the batch carries no signal. The share is the reward sources' rule
    (postrl/errors.py); a rollout cut short (some program still "running") is not judged."""
    if any(s.outcome == "running" for s in sessions):
        return
    failed = [s for s in sessions if s.outcome in ("error", "timeout")]
    if not fails_nearly_always(len(sessions), len(failed)):
        return
    errors = [" ".join(s.error.split()) for s in failed if s.outcome == "error"]  # one paragraph
    timeouts = len(failed) - len(errors)
    what = f"rollout.environment '{cfg.environment}'" if getattr(cfg, "environment", None) else f"the agent program (rollout.agent '{cfg.agent}')"
    counts = f"{len(errors)} raised or returned no reward, {timeouts} ran past rollout.agent_timeout_s ({cfg.agent_timeout_s:g} s)"
    refused = next((s for s in failed if s.outcome == "error" and s.bad_requests), None)
    example = f"the first error: {errors[0][:600]}" if errors else "none raised"
    if refused is not None:  # e.g. "never called the model": the endpoint answered its every request 400
        example += f" (the endpoint refused {refused.bad_requests} of its requests with a 400 that says why, counted in agent/bad_requests)"
    if errors:
        fix = ("Fix the program so it runs on one row (the error above is its own; a 400 from the endpoint names what the "
               "request lacked, e.g. a prompt past the run's context: shorten the system prompt or raise "
               "data.max_prompt_length / rollout.max_tokens)")  # fmt: skip
    else:
        fix = "Raise rollout.agent_timeout_s if the program is slow but correct, or find where it waits"
    raise UserError(
        f"{what} failed on {len(failed)} of the {len(sessions)} samples of this batch ({counts}); {example}. A failed "
        "sample scores 0 and trains nothing, so the batch carries no signal and training would learn nothing. "
        f"{fix}; the counts are the agent/errors and agent/timeouts metrics.",
        title="the agent program fails on (nearly) every sample",
    )
