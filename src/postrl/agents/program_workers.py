"""`rollout.agent_workers: N`: the users' agent programs in N worker processes, each with a GIL of its own.

In the trainer's process every program's CPU (the `openai` client costs ~2.5 ms a request, the
user's tools more) shares one GIL with the engine thread and the endpoint. A worker is a fresh
interpreter (`python -m postrl.agents.program_workers`, exec'd: the trainer is never forked, its
torch / vLLM threads stay where they are) that imports only postrl's small agent modules, `openai`
and the user's module by its spec (`load_agent`), and runs many programs at once exactly as the
in-process path does (agents/programs.py: a thread per sync program, one event loop for async ones,
an `openai` client per program pointed at its session's URL).

The parent sends (session key, session URL, model name, row) over a socket pair and a reader thread
per worker turns each reply (key, "ok" | "error", value) into the gateway's ("done", session, ...)
event, so time limits, counting and recording are the in-process path's. A worker that dies
(`os._exit`, a segfault, the OOM killer) ends its running programs as errors and is started again;
a worker holding a program past `agent_timeout_s` is killed and started again at the end of the
`generate` call (a thread cannot be killed; a process can).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from postrl.agents.programs import Programs, load_agent
from postrl.agents.session import Session


def _remote_error(name: str, message: str) -> Exception:
    """The user's exception as the gateway reports it ("ValueError: the user's bug"), without unpickling user types."""
    return type(name, (Exception,), {})(message)


class _Worker:
    """One worker process, its connection, and the programs it runs (key -> session)."""

    def __init__(self, spec: str, timeout_s: float, events: queue.Queue):
        parent, child = socket.socketpair()
        src = str(Path(__file__).resolve().parents[2])  # postrl's own source root, whatever sys.path the worker gets
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "postrl.agents.program_workers", str(child.fileno())], pass_fds=(child.fileno(),), env=env,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send({"sys_path": list(sys.path), "spec": spec, "timeout_s": timeout_s})
        self.running: dict[str, Session] = {}
        self.stuck = False  # holds a program past its time limit: killed at the end of the rollout
        self.dead = False
        self._events, self._lock = events, threading.Lock()
        threading.Thread(target=self._read, name=f"postrl-agent-worker-{self.proc.pid}", daemon=True).start()

    def launch(self, s: Session, url: str, model_name: str) -> bool:
        """Send the program to the worker; False if the worker has ended (its reader has reported its programs)."""
        with self._lock:
            if self.dead:
                return False
            self.running[s.key] = s
        try:
            self.conn.send((s.key, url, model_name, s.row))
        except (OSError, ValueError):  # the worker is gone: its reader reports this program with the others
            self.proc.kill()
        except Exception as exc:  # noqa: BLE001 - the row does not pickle: this program fails, not the rollout
            with self._lock:
                self.running.pop(s.key, None)
            self._events.put(("done", s, "error", exc))
        return True

    def _read(self) -> None:
        while True:
            try:
                key, outcome, value = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                s = self.running.pop(key, None)
            if s is not None:
                self._events.put(("done", s, outcome, _remote_error(*value) if outcome == "error" else value))
        code = self.proc.wait()
        with self._lock:
            self.dead, lost, self.running = True, list(self.running.values()), {}
        for s in lost:
            message = f"the agent's worker process ended (exit code {code}) while this program ran"
            self._events.put(("done", s, "error", RuntimeError(message)))

    def close(self) -> None:
        self.dead = True
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)  # the worker exits when its connection ends (close alone would wait for the
        self.conn.close()  # reader thread's recv to return)
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Handle:
    """What the gateway holds for a program running in a worker: `cancel()` when it overran its time limit."""

    def __init__(self, worker: _Worker, key: str):
        self.worker, self.key = worker, key

    def cancel(self) -> None:
        with self.worker._lock:
            if self.worker.running.pop(self.key, None) is not None:
                self.worker.stuck = True


class WorkerPool:
    """`Programs` (agents/programs.py) across `n` worker processes: `launch` sends a program to the worker
    running the fewest; `reap` (end of a rollout) replaces the workers that hold stuck programs or died."""

    def __init__(self, spec: str, n: int, cfg: Any, events: queue.Queue):
        self.agent = load_agent(spec)  # the user's errors are raised here, in the trainer, once
        self.is_async = inspect.iscoroutinefunction(self.agent)
        self.spec, self.cfg, self._events = spec, cfg, events
        self.workers: list[_Worker | None] = [None] * n
        self.restarts = 0
        self.start()  # a worker takes ~1 s to import openai: started now, they are ready by the first rollout

    def _worker(self, i: int) -> _Worker:
        w = self.workers[i]
        if w is None or w.dead:
            self.restarts += w is not None
            w = self.workers[i] = _Worker(self.spec, self.cfg.agent_timeout_s, self._events)
        return w

    def start(self) -> None:
        for i in range(len(self.workers)):
            self._worker(i)

    def launch(self, s: Session, url: str, model_name: str) -> _Handle:
        while True:
            self.start()
            w = min(self.workers, key=lambda w: len(w.running))
            if w.launch(s, url, model_name):
                return _Handle(w, s.key)

    def reap(self) -> None:
        """Kill the workers that hold a program past its time limit (the rollout is over: nothing else of theirs
        runs) and start them and any that died again."""
        for i, w in enumerate(self.workers):
            if w is not None and w.stuck and not w.dead:
                w.proc.kill()
                w.proc.wait()
                w.dead = True
            if w is not None and w.dead:
                self._worker(i)

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.close()
        self.workers = [None] * len(self.workers)


def _serve(conn: Connection) -> None:
    """A worker: run the programs the parent sends, report each one's end; exit when the connection ends."""
    import httpx  # noqa: F401 - imported before the first program comes, not by it
    import openai  # noqa: F401

    init = conn.recv()
    sys.path[:] = init["sys_path"]
    events: queue.Queue = queue.Queue()
    try:
        programs = Programs(load_agent(init["spec"]), SimpleNamespace(agent_timeout_s=init["timeout_s"]), events)
    except BaseException as exc:  # noqa: BLE001 - cannot happen after the parent loaded it, unless the module differs here
        print(f"postrl agent worker: loading {init['spec']} failed: {exc}", file=sys.stderr)
        os._exit(3)

    # warm up while no program waits: openai loads its resources and types on first use (~1 s), httpx its SSL context
    kind = openai.AsyncOpenAI if programs.is_async else openai.OpenAI
    _ = kind(base_url="http://127.0.0.1:9/v1", api_key="-", http_client=programs._http_client(programs.is_async)).chat.completions
    import openai.types.chat  # noqa: F401

    def send() -> None:
        while True:
            _, s, outcome, value = events.get()
            if outcome == "error":
                value = (type(value).__name__, str(value))
            elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                text = f"the agent returned {type(value).__name__} {value!r:.60}; it must return a number or None"
                outcome, value = "error", ("TypeError", text)  # what the gateway says of it in-process, not pickled
            try:
                conn.send((s.key, outcome, value))
            except OSError:  # the parent is gone
                os._exit(0)

    threading.Thread(target=send, name="postrl-agent-worker-send", daemon=True).start()
    while True:
        try:
            key, url, model_name, row = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent closed the pool or died: the programs' threads end with the process
        programs.launch(SimpleNamespace(key=key, row=row), url, model_name)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
