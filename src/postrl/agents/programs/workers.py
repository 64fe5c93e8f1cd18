"""`rollout.agent_workers: N`: the users' agent programs in N worker processes, each with a GIL of its own.

In the trainer's process every program's CPU (the `openai` client costs ~2.5 ms a request, the
user's tools more) shares one GIL with the engine thread and the endpoint. A worker is a fresh
interpreter (`python -m postrl.agents.programs.workers`, exec'd: the trainer is never forked, its
torch / vLLM threads stay where they are) that imports only postrl's small agent modules, `openai`
and the user's module by its spec (`load_agent`), and runs many programs at once exactly as the
in-process path does (agents/programs/programs.py: a thread per sync program, one event loop for async ones,
an `openai` client per program pointed at its session's URL).

The parent sends [session key, session URL, model name, row] over a socket pair, as postrl/ipc.py's
JSON frames (no time limit on a frame: a worker holding one up is a stuck worker, killed as one), and
a reader thread per worker turns each reply [key, "ok" | "error", value] into the gateway's ("done",
session, ...) event, so time limits, counting and recording are the in-process path's. Nothing a
worker sends is unpickled: its frames are capped (MAX_REPLY_BYTES, 64 levels deep) and checked
(`parse_reply`), and a bad one ends that worker as a death does. The worker starts from a scrubbed
environment (children.py). A worker that dies (`os._exit`, a segfault, the OOM killer, or
mid-frame) ends its running programs as errors and is started again; a worker holding a program past
`agent_timeout_s` is killed and started again at the end of the `generate` call (a thread cannot be
killed; a process can).
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
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from postrl import ipc
import postrl.agents.results as results
from postrl.children import child_env
from postrl.agents.programs.programs import Programs, check_outcomes, load_agent
from postrl.agents.session import Session
from postrl.ipc import FrameError

MAX_REPLY_BYTES = 64 * 1024  # a worker's frame: (key, outcome, a number or a short error) needs far less
MAX_ROW_BYTES = 1 << 30  # the trainer's frames to a worker: trusted, as large as its dataset rows
MAX_ROW_DEPTH = 1000  # and as deep: a row nested past this is no dataset's
MAX_ERROR_CHARS = 2000  # a worker cuts the user's exception message to this before sending it

BadFrame = FrameError  # a frame that is not what the protocol allows: too long, not JSON, or not of the expected shape


def parse_reply(msg: Any) -> tuple[str, str, Any]:
    """(key, "ok", number | None) or (key, "error", exception) from a worker's frame; BadFrame for any other shape."""
    if not (isinstance(msg, list) and len(msg) == 3 and isinstance(msg[0], str) and len(msg[0]) <= 64):
        raise BadFrame(f"a frame that is not [key, outcome, value]: {str(msg)[:100]!r}")
    key, outcome, value = msg
    if outcome == "ok" and value is None:
        return key, outcome, None
    if outcome == "ok" and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:  # the worker checks a program's return before it sends it: out of range here, the worker is broken
            return key, outcome, results.reward(value, "the agent's return")
        except results.BadResult as exc:
            raise BadFrame(f"a reward out of range in a worker's reply: {exc}") from None
    if outcome == "error" and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return key, outcome, _remote_error(value[0][:100], value[1][:MAX_ERROR_CHARS])
    raise BadFrame(f"a frame whose outcome is not ok with a number or error with [type, message]: {str(msg)[:100]!r}")


def _remote_error(name: str, message: str) -> Exception:
    """The user's exception as the gateway reports it ("ValueError: the user's bug"), a plain Exception of that name."""
    return type(name if name.isidentifier() else "Exception", (Exception,), {})(message)


class _Worker:
    """One worker process, its socket, and the programs it runs (key -> session). Programs go out through a
    writer thread (a worker that stops reading holds its own programs up, never the engine thread); a reader
    thread turns each reply frame into the gateway's "done" event. A bad frame (too long, not JSON, of another
    shape) or anything else the reader meets ends that worker: its process is killed, its running programs are
    reported as errors, and the pool starts a new one."""

    def __init__(self, spec: str, timeout_s: float, events: queue.Queue, passthrough: list[str] = ()):
        parent, child = socket.socketpair()
        src = str(Path(__file__).resolve().parents[3])  # postrl's own source root, whatever sys.path the worker gets
        pythonpath = os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "postrl.agents.programs.workers", str(child.fileno())], pass_fds=(child.fileno(),),
            env=child_env(passthrough, {"PYTHONPATH": pythonpath}), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        child.close()
        self.sock = parent
        self.running: dict[str, Session] = {}
        self.stuck = False  # holds a program past its time limit: killed at the end of the rollout
        self.dead = False
        self.bad_frame: str | None = None  # why the reader ended the worker, when a frame was bad
        self._events, self._lock = events, threading.Lock()
        self._out: queue.Queue = queue.Queue()
        self._out.put(ipc.encode({"sys_path": list(sys.path), "spec": spec, "timeout_s": timeout_s}))
        threading.Thread(target=self._write, name=f"postrl-agent-worker-w{self.proc.pid}", daemon=True).start()
        threading.Thread(target=self._read, name=f"postrl-agent-worker-{self.proc.pid}", daemon=True).start()

    def launch(self, s: Session, url: str, model_name: str) -> bool:
        """Send the program to the worker; False if the worker has ended (its reader has reported its programs)."""
        try:
            frame = ipc.encode([s.key, url, model_name, s.row])
        except (TypeError, ValueError) as exc:  # the row cannot go to a worker: this program fails, not the rollout
            self._events.put(("done", s, "error", TypeError(f"the dataset row does not convert to JSON for a worker process ({exc})")))
            return True
        with self._lock:
            if self.dead:
                return False
            self.running[s.key] = s
        self._out.put(frame)
        return True

    def _write(self) -> None:
        while (frame := self._out.get()) is not None:
            try:
                self.sock.sendall(frame)
            except OSError:  # the worker is gone: its reader reports its programs
                self.proc.kill()
                return

    def _read(self) -> None:
        why = None
        try:
            while True:
                try:
                    key, outcome, value = parse_reply(ipc.recv(self.sock, MAX_REPLY_BYTES, None))
                except (EOFError, OSError):
                    break
                with self._lock:
                    s = self.running.pop(key, None)
                if s is not None:  # else: a program the gateway already ended (its time ran out)
                    self._events.put(("done", s, outcome, value))
        except BadFrame as exc:  # unless the pool killed the worker mid-frame (it held a program past its time)
            why = None if self.stuck else f"the agent's worker process sent {exc}; it was killed and started again"
        except BaseException as exc:  # noqa: BLE001 - the reader must report the worker's programs, whatever happened
            why = f"reading the agent's worker process failed ({type(exc).__name__}: {exc}); it was killed and started again"
        self.bad_frame = why
        if why is not None:
            self.proc.kill()
        code = self.proc.wait()
        self._out.put(None)
        with self._lock:
            self.dead, lost, self.running = True, list(self.running.values()), {}
        for s in lost:
            message = why or f"the agent's worker process ended (exit code {code}) while this program ran"
            self._events.put(("done", s, "error", RuntimeError(message)))

    def close(self) -> None:
        self.dead = True
        self._out.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # the worker exits when its connection ends; the reader's recv returns
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


class _Handle:
    """What the gateway holds for a program running in a worker: `cancel()` when it overran its time limit."""

    def __init__(self, worker: _Worker, key: str):
        self.worker, self.key = worker, key

    def cancel(self) -> None:
        with self.worker._lock:
            if self.worker.running.pop(self.key, None) is not None:
                self.worker.stuck = True


class WorkerPool:
    """`Programs` (agents/programs/programs.py) across `n` worker processes: `launch` sends a program to the worker
    running the fewest; `reap` (end of a rollout) replaces the workers that hold stuck programs or died, and
    stops the run when (nearly) every program of the rollout failed (`check_outcomes`)."""

    def __init__(self, spec: str, n: int, cfg: Any, events: queue.Queue):
        self.agent = load_agent(spec)  # the user's errors are raised here, in the trainer, once
        self.is_async = inspect.iscoroutinefunction(self.agent)
        self.spec, self.cfg, self._events = spec, cfg, events
        self.workers: list[_Worker | None] = [None] * n
        self.restarts = self.bad_frames = 0
        self.launched: list[Session] = []  # this rollout's programs, for `check_outcomes`
        self.start()  # a worker takes ~1 s to import openai: started now, they are ready by the first rollout

    def _worker(self, i: int) -> _Worker:
        w = self.workers[i]
        if w is None or w.dead:
            self.restarts += w is not None
            self.bad_frames += w is not None and w.bad_frame is not None
            w = self.workers[i] = _Worker(self.spec, self.cfg.agent_timeout_s, self._events, self.cfg.agent_env_passthrough)
        return w

    def start(self) -> None:
        for i in range(len(self.workers)):
            self._worker(i)

    def launch(self, s: Session, url: str, model_name: str) -> _Handle:
        self.launched.append(s)
        while True:
            self.start()
            w = min(self.workers, key=lambda w: len(w.running))
            if w.launch(s, url, model_name):
                return _Handle(w, s.key)

    def reap(self) -> None:
        """Kill the workers that hold a program past its time limit (the rollout is over: nothing else of theirs
        runs) and start them and any that died again; then the rule of `check_outcomes` on this rollout."""
        for i, w in enumerate(self.workers):
            if w is not None and w.stuck and not w.dead:
                w.proc.kill()
                w.proc.wait()
                w.dead = True
            if w is not None and w.dead:
                self._worker(i)
        launched, self.launched = self.launched, []
        check_outcomes(launched, self.cfg)

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.close()
        self.workers = [None] * len(self.workers)


def _serve(sock: socket.socket) -> None:
    """A worker: run the programs the parent sends, report each one's end; exit when the connection ends."""
    import httpx  # noqa: F401 - imported before the first program comes, not by it
    import openai  # noqa: F401

    init = ipc.recv(sock, MAX_ROW_BYTES, None, MAX_ROW_DEPTH)
    sys.path[:] = init["sys_path"]
    events: queue.Queue = queue.Queue()
    try:
        programs = Programs(load_agent(init["spec"]), SimpleNamespace(agent_timeout_s=init["timeout_s"]), events, check=False)
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
            if outcome == "ok" and value is not None:  # checked as in process (agents/results.py), then checked again there
                try:
                    value = results.reward(value, "the agent's return")
                except results.BadResult as exc:
                    outcome, value = "error", results.BadResult(f"{exc}, or None")
            if outcome == "error":
                value = [type(value).__name__, results.error_text(value).partition(": ")[2]]
            try:
                sock.sendall(ipc.encode([s.key, outcome, value]))
            except OSError:  # the parent is gone
                os._exit(0)

    threading.Thread(target=send, name="postrl-agent-worker-send", daemon=True).start()
    while True:
        try:
            key, url, model_name, row = ipc.recv(sock, MAX_ROW_BYTES, None, MAX_ROW_DEPTH)
        except (EOFError, OSError):
            os._exit(0)  # the parent closed the pool or died: the programs' threads end with the process
        programs.launch(SimpleNamespace(key=key, row=row), url, model_name)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
