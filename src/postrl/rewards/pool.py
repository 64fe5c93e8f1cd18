"""A pool of verifier worker processes with a hard per-call time limit.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop one stuck task. Here every worker
has its own pipe and runs one call at a time; the parent tracks each call's deadline and, when a
call overruns it, kills that worker (SIGKILL), reports the call as timed out and starts a
replacement in the background. Two limits apply:

- soft, inside the worker: an interval timer interrupts Python-level work (sympy simplification
  loops) at 80% of `timeout_s`; the worker survives and takes the next call;
- hard, in the parent: at `timeout_s` after dispatch the worker is killed, which also stops work
  stuck in C (a huge integer power) that no signal can interrupt.

Workers also get an address-space limit, so an input that makes sympy allocate gigabytes fails
with MemoryError inside the worker instead of exhausting the machine. Workers are started with the
`spawn` method (safe beside torch threads), once, and reused until `close()`; each first makes its environment
the allowlisted one of children.py (no HF_TOKEN or other credential, HOME an empty directory).

Trust flows down only. The parent's calls go to a worker pickled (the verifier function travels by
name). A worker reads model-written text with sympy, which evaluates what it parses, so its replies
are hostile input: each is one `send_bytes` frame of JSON, read raw from the pipe by postrl/ipc.py (at
most MAX_REPLY_BYTES, complete within FRAME_TIMEOUT_S; never unpickled) and parsed into a declared
shape (`Ready` or `Reply`, pydantic, strict). A frame that is too long, cut short, not JSON, not of
that shape, or for a task the worker was not given ends that worker as a hard time limit does: it
is killed and replaced, and its call in flight is an error ("verifier worker sent a malformed
reply: ..."), counted in `malformed_replies`.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, TypeAdapter, ValidationError, model_validator

from postrl.ipc import FrameError, recv_bytes
from postrl.rewards.verdict import InvalidVerdict, VerifierResult, to_result

log = logging.getLogger("postrl.rewards")

BOOT_TIMEOUT_S = 180.0  # importing sympy/math-verify on a loaded 2-core machine can take a while
MAX_BOOT_FAILURES = 3
MAX_REPLY_BYTES = 64 * 1024  # a worker's frame: a score, a few named metrics and a short message need far less
MAX_MESSAGE_CHARS = 500  # a worker cuts an error message to this before sending it
FRAME_TIMEOUT_S = 5.0  # from a frame's first byte to its last (a worker writes a frame at once)


@dataclass
class Call:
    """One verifier call to run in a worker."""

    fn: Callable[..., Any]
    completion: str
    ground_truth: str
    row: dict


@dataclass
class Outcome:
    """What became of a call: status is "ok", "timeout", "error" (it raised) or "invalid" (it returned
    no finite score); message says why."""

    status: str
    result: VerifierResult | None = None
    message: str = ""


class _SoftTimeout(BaseException):
    """Raised by the worker's interval timer. A BaseException so that verifiers (and math-verify,
    which catches Exception broadly) cannot swallow it."""


def _worker_main(conn: Connection, soft_timeout_s: float, memory_limit_mb: int | None, passthrough: tuple[str, ...] = ()) -> None:
    import signal

    from postrl.children import scrub_environ

    scrub_environ(passthrough)  # first: sympy evaluates what the model wrote; no token, no home of the trainer's

    if memory_limit_mb:
        try:
            import resource

            limit = memory_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):  # pragma: no cover - platform without RLIMIT_AS
            pass
    armed = False

    def on_alarm(signum, frame):  # noqa: ARG001
        if armed:
            raise _SoftTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    # Ctrl-C and a scheduler's SIGTERM to the process group are the parent's business: it finishes the
    # step in flight (whose rewards must not lose a worker mid-call), saves, and then kills the pool
    # with SIGKILL (`close`, also registered at exit, before multiprocessing's own SIGTERM would hang).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    import postrl.rewards.equivalence as equivalence

    equivalence.disable_signal_timeout()
    import math_verify  # noqa: F401  (warm the import before reporting ready)

    conn.send_bytes(json.dumps({"kind": "ready", "pid": os.getpid()}).encode())
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, call = msg
        try:
            armed = True
            signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
            try:
                res = to_result(call.fn(call.completion, call.ground_truth, call.row))
            finally:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            out = Outcome("ok", res)
        except _SoftTimeout:
            out = Outcome("timeout", message=f"soft time limit ({soft_timeout_s:.2f} s)")
        except InvalidVerdict as exc:
            out = Outcome("invalid", message=str(exc))
        except MemoryError:
            out = Outcome("error", message="out of memory in the verifier worker")
        except BaseException as exc:  # noqa: BLE001 - a verifier's bug must not kill the worker
            out = Outcome("error", message=f"{type(exc).__name__}: {exc}")
        conn.send_bytes(encode_reply(task_id, out))


def encode_reply(task_id: int, out: Outcome) -> bytes:
    """The worker's frame for `out` (JSON; see `Reply`), or an error outcome's frame when `out` cannot be
    sent: a metric that is not a number, or a result over MAX_REPLY_BYTES."""
    try:
        result = None
        if out.status == "ok" and out.result is not None:
            metrics = {_utf8(str(k)): float(v) for k, v in out.result.metrics.items()}
            result = {"score": float(out.result.score), "metrics": metrics}
        reply = {"kind": "reply", "task": task_id, "status": out.status, "message": _utf8(out.message[:MAX_MESSAGE_CHARS])}
        data = json.dumps({**reply, "result": result}).encode()
        if len(data) <= MAX_REPLY_BYTES:
            return data
        why = f"{len(data)} bytes of JSON, at most {MAX_REPLY_BYTES}: return fewer or shorter metrics"
    except Exception as exc:  # noqa: BLE001 - e.g. a metric value float() refuses
        why = f"{type(exc).__name__}: {exc}"
    message = f"result could not be sent back ({why})"[:MAX_MESSAGE_CHARS]
    return json.dumps({"kind": "reply", "task": task_id, "status": "error", "message": message, "result": None}).encode()


def _utf8(text: str) -> str:
    """`text` with lone surrogates (model text can hold them) replaced: JSON parsers refuse them."""
    return text.encode("utf-8", "replace").decode("utf-8")


# ------------------------------------------------------------------ what a worker may send
BadReply = FrameError  # a worker's frame that the protocol does not allow; the message says how


class _Frame(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Ready(_Frame):
    """A worker's first frame: it has started and imported math-verify."""

    kind: Literal["ready"]
    pid: int


class ResultFrame(_Frame):
    """A `VerifierResult`: the score is finite (the worker's `to_result` refused any other); metrics may be any
    float, as `to_result` lets them be."""

    score: FiniteFloat
    metrics: dict[str, float]


class Reply(_Frame):
    """The outcome of task `task`: a result exactly when the status is ok."""

    kind: Literal["reply"]
    task: int
    status: Literal["ok", "timeout", "error", "invalid"]
    message: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]
    result: ResultFrame | None

    @model_validator(mode="after")
    def _result_iff_ok(self) -> "Reply":
        if (self.result is not None) != (self.status == "ok"):
            raise ValueError("a result comes with status ok, and only with it")
        return self


_FRAME = TypeAdapter(Annotated[Union[Ready, Reply], Field(discriminator="kind")])


def parse_frame(data: bytes) -> Ready | Reply:
    """A worker's frame in its declared shape; BadReply for anything else (never unpickled: JSON only, depth
    bounded by pydantic's parser)."""
    try:
        return _FRAME.validate_json(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise BadReply(f"{first['msg']}{f' at {where}' if where else ''} ({len(data)} bytes)") from None
    except Exception as exc:  # noqa: BLE001 - whatever else the parser meets is the frame's fault
        raise BadReply(f"{type(exc).__name__} while parsing ({len(data)} bytes)") from None


class _Worker:
    def __init__(self, ctx, soft_timeout_s: float, memory_limit_mb: int | None, passthrough: tuple[str, ...] = ()):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main, args=(child, soft_timeout_s, memory_limit_mb, passthrough), daemon=True, name="postrl-verifier"
        )
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class VerifierPool:
    """Runs verifier calls in `workers` processes, each call under a hard `timeout_s` limit."""

    def __init__(self, workers: int, timeout_s: float, memory_limit_mb: int | None = 4096, passthrough: tuple[str, ...] = ()):
        """`passthrough`: environment names the workers get beside the allowlist (reward.env_passthrough)."""
        assert workers >= 1, "the pool needs at least one worker"
        assert timeout_s > 0, "timeout_s must be positive"
        self.n_workers = workers
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.passthrough = tuple(passthrough)
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._boot_failures = 0
        self.restarts = 0
        self.malformed_replies = 0  # frames that broke the protocol (each ended its worker)

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, 0.8 * self.timeout_s, self.memory_limit_mb, self.passthrough)

    def start(self) -> None:
        if not self._workers:
            atexit.register(self.close)  # runs before multiprocessing's exit handler (registered earlier)
        while len(self._workers) < self.n_workers:
            self._workers.append(self._spawn())

    def close(self) -> None:
        for w in self._workers:
            try:
                if w.ready and w.task is None:
                    w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()
        self._workers = []

    def __del__(self):  # best effort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = self._spawn()
        self.restarts += 1

    # ---------------------------------------------------------------------- run
    def run(self, calls: list[Call]) -> list[Outcome]:
        """Run every call; never raises for a bad call, never waits longer than its limit per call."""
        self.start()
        results: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(w.task is not None for w in self._workers):
            for w in self._workers:
                while w.ready and w.task is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((i, calls[i]))
                    except (OSError, ValueError) as exc:  # worker died between calls
                        pending.appendleft(i)
                        log.warning("verifier worker %s was lost (%s); restarting it", w.proc.pid, exc)
                        self._replace(w)
                        break
                    except Exception as exc:  # noqa: BLE001 - the call itself cannot be pickled
                        results[i] = Outcome("error", message=f"call could not be sent to a worker: {exc}"[:500])
                        continue
                    w.task, w.deadline = i, time.monotonic() + self.timeout_s
            now = time.monotonic()
            deadlines = [w.deadline for w in self._workers if w.task is not None]
            deadlines += [w.started + BOOT_TIMEOUT_S for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.05
            ready = wait([w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers], timeout=wait_s)
            for w in list(self._workers):
                if w.conn in ready or (w.proc.sentinel in ready and w.conn.poll()):
                    self._receive(w, results)
                elif w.proc.sentinel in ready:
                    self._on_death(w, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now > w.deadline:
                    results[w.task] = Outcome("timeout", message=f"hard time limit ({self.timeout_s:g} s)")
                    w.task = None
                    self._replace(w)
                elif not w.ready and now > w.started + BOOT_TIMEOUT_S:
                    self._boot_failed(w, f"did not start within {BOOT_TIMEOUT_S:.0f} s")
        return [r if r is not None else Outcome("error", message="lost") for r in results]

    def _receive(self, w: _Worker, results: list[Outcome | None]) -> None:
        try:
            msg = parse_frame(recv_bytes(w.conn, MAX_REPLY_BYTES, FRAME_TIMEOUT_S))
            if isinstance(msg, Ready) and (w.ready or msg.pid != w.proc.pid):
                raise BadReply(f"a ready message (pid {msg.pid}) from worker {w.proc.pid}, ready already: {w.ready}")
            if isinstance(msg, Reply) and msg.task != w.task:
                raise BadReply(f"a reply for task {msg.task}, while the worker was given {w.task}")
        except (EOFError, OSError):
            self._on_death(w, results)
            return
        except BadReply as exc:
            self._on_malformed(w, results, str(exc))
            return
        if isinstance(msg, Ready):
            w.ready = True
            self._boot_failures = 0
            return
        res = msg.result
        results[msg.task] = Outcome(msg.status, VerifierResult(res.score, dict(res.metrics)) if res else None, msg.message)
        w.task = None

    def _on_malformed(self, w: _Worker, results: list[Outcome | None], why: str) -> None:
        self.malformed_replies += 1
        log.warning("verifier worker %s sent a malformed reply (%s); restarting it", w.proc.pid, why)
        if not w.ready:
            self._boot_failed(w, f"sent a malformed first message: {why}")
            return
        if w.task is not None:
            results[w.task] = Outcome("error", message=f"verifier worker sent a malformed reply: {why}"[:MAX_MESSAGE_CHARS])
            w.task = None
        self._replace(w)

    def _on_death(self, w: _Worker, results: list[Outcome | None]) -> None:
        if not w.ready:
            self._boot_failed(w, f"exited with code {w.proc.exitcode} while starting")
            return
        if w.task is not None:
            results[w.task] = Outcome("error", message=f"verifier worker died (exit code {w.proc.exitcode})")
            w.task = None
        self._replace(w)

    def _boot_failed(self, w: _Worker, why: str) -> None:
        self._boot_failures += 1
        if self._boot_failures >= MAX_BOOT_FAILURES:
            self.close()
            raise RuntimeError(
                f"verifier worker processes cannot start: the last one {why}. Check that postrl and "
                "math-verify import in a fresh interpreter, and that a script using postrl guards its "
                "entry point with `if __name__ == '__main__':` (workers are started with 'spawn')."
            )
        self._replace(w)
