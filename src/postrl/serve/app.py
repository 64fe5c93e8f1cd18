"""The Tinker API over HTTP: routes, the key, the limits, and the futures the SDK polls.

    GET  /api/v1/healthz                       200 {"status": "ok"} once the model is loaded (no key needed)
    POST /api/v1/{create_model, forward_backward, optim_step, save_weights_for_sampler, asample, ...}
                                               -> {"request_id": ...}: the work is queued, its result is a future
    POST /api/v1/retrieve_future               -> the result, {"type": "try_again"} while it runs, or
                                                  {"error", "category"} when that request failed

Every request but healthz carries the server's key in `X-API-Key` (the SDK's header; compared in constant
time). Bodies are capped before they are read (`HttpLimits.max_body_bytes`; connections, header and body
deadlines are the rollout endpoint's own machinery, agents/endpoint/server.py), JSON nests at most `max_json_depth`,
and every body is parsed into the SDK's own request model (pydantic, extra fields refused) or, for
forward_backward, its protobuf (serve/wire.py), with datum and token counts bounded, before any work starts.
A bad body is a 400 naming what is wrong.

One engine thread runs the work, one request at a time in arrival order (the SDK sends a training client's
requests in its own order, so arrival order is that order). A request that fails is its future's error
(category user for a bad request, server for a fault of ours), never the server's end. Futures outlive the
connection that made them: a client that disconnects and polls again gets the same result; results are kept
for `keep_s` seconds after they finish (at most `keep` of them).
"""

# no `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request) at runtime

import asyncio
import concurrent.futures
import hmac
import logging
import queue
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from postrl.errors import UserError

log = logging.getLogger("postrl.serve")
PROTO = "application/x-protobuf"


@dataclass(frozen=True)
class Limits:
    """What the Tinker server enforces beyond the HTTP side's limits."""

    max_datums: int = 4096  # per forward_backward request
    max_tokens: int = 32768  # per datum or prompt
    max_samples: int = 256  # num_samples per asample
    max_json_depth: int = 32
    max_queued: int = 4096  # requests waiting for the engine thread
    poll_s: float = 20.0  # how long retrieve_future waits for a result before answering try_again (the SDK waits 45 s)
    keep: int = 10000  # finished futures kept for clients that poll again
    keep_s: float = 3600.0


@dataclass
class _Entry:
    future: concurrent.futures.Future
    done_at: float = 0.0  # monotonic time it finished (0: running or queued)


class Jobs:
    """The engine thread and the futures of its work, by request id."""

    def __init__(self, limits: "Limits"):
        self.limits = limits
        self.queue: queue.Queue = queue.Queue()
        self.futures: OrderedDict[str, _Entry] = OrderedDict()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="postrl-tinker-engine", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> str:
        if self.queue.qsize() >= self.limits.max_queued:
            raise UserError(f"the server has {self.limits.max_queued} requests waiting; retry later")
        request_id, entry = uuid.uuid4().hex, _Entry(concurrent.futures.Future())
        entry.future.add_done_callback(lambda _: setattr(entry, "done_at", time.monotonic()))
        with self.lock:
            self._forget_old()
            self.futures[request_id] = entry
        self.queue.put((entry.future, fn))
        return request_id

    def get(self, request_id: str) -> concurrent.futures.Future | None:
        with self.lock:
            entry = self.futures.get(request_id)
        return entry.future if entry else None

    def _forget_old(self) -> None:
        """Drop finished futures older than keep_s, and the oldest finished ones beyond `keep`."""
        now = time.monotonic()
        for rid, entry in list(self.futures.items()):
            if entry.done_at and (len(self.futures) > self.limits.keep or now - entry.done_at > self.limits.keep_s):
                del self.futures[rid]

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            future, fn = item
            try:
                future.set_result(fn())
            except UserError as exc:
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - a fault on one request is that request's error, never the server's
                log.error("a request failed: %s", "".join(traceback.format_exception(exc)))
                future.set_exception(exc)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread, in order with the queued work, and wait for it (shutdown, tests)."""
        request_id = self.submit(fn)
        return self.get(request_id).result()

    def cancel_queued(self, why: str) -> int:
        """Fail every request not yet started with `why` (a stopping server does not run stale work); how many."""
        n = 0
        while True:
            try:
                future, _ = self.queue.get_nowait()
            except queue.Empty:
                return n
            future.set_exception(UserError(why))
            n += 1

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)


class TooLarge(UserError):
    """A body over the cap: 413."""


def make_app(service: Any, api_key: str, http: Any, limits: Limits, refused: Any) -> Any:
    """The ASGI app; `service` (serve/service.py) answers each route's parsed request."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    from postrl.untrusted import Unreadable, json_object

    app = FastAPI(title="postrl Tinker API", docs_url=None, redoc_url=None, openapi_url=None)

    said: set[tuple[str, int]] = set()

    def refuse(request: Request, status: int, why: str) -> None:
        """Count a refused request; the first of each route and status goes to the log with why (at most 100)."""
        refused.add()
        where = f"{request.method} {request.url.path}"[:200]
        if (where, status) not in said and len(said) < 100:
            said.add((where, status))
            log.warning("refused %s (%d): %s", _printable(where), status, _printable(why[:300]))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        refuse(request, exc.status_code, str(exc.detail))
        return JSONResponse(
            {"detail": f"{request.method} {request.url.path}: {exc.detail} (see docs/tinker.md for what this server serves)"},
            status_code=exc.status_code,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        refused.add()
        log.error("the server failed on %s: %s", request.url.path, "".join(traceback.format_exception(exc)))
        return JSONResponse({"detail": f"the server failed on this request: {type(exc).__name__}"}, status_code=500)

    async def body_of(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > http.max_body_bytes):
            raise TooLarge(f"the body is over {http.max_body_bytes} bytes (--max-body-bytes)")
        chunks, size = [], 0
        async with asyncio.timeout(http.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > http.max_body_bytes:
                    raise TooLarge(f"the body is over {http.max_body_bytes} bytes (--max-body-bytes)")
                chunks.append(chunk)
        return b"".join(chunks)

    def authorised(request: Request) -> bool:
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), api_key.encode())

    def parse_json(raw: bytes, model: Any) -> Any:
        try:
            body = json_object(raw or b"{}", limits.max_json_depth)
        except Unreadable as exc:
            raise UserError(str(exc)) from None
        if model is None:
            return body
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            err = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(x) for x in err["loc"])
            raise UserError(f"'{where}': {err['msg']}" if where else err["msg"]) from None

    def answer(result: Any) -> Response:
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        if hasattr(result, "model_dump"):
            result = result.model_dump(mode="json", exclude_none=True)
        return JSONResponse(result)

    @app.get("/api/v1/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def handle(request: Request, name: str) -> Response:
        if not authorised(request):
            refuse(request, 401, "a missing or wrong API key")
            return JSONResponse({"detail": "a missing or wrong API key (X-API-Key; the server's --api-key)"}, status_code=401)
        head, _, rest = name.partition("/")
        route, extra = service.routes.get(name), ()
        if route is None and rest and head in service.routes:  # GET /api/v1/samplers/<id>
            route, extra = service.routes[head], (rest,)
        if route is None:
            raise HTTPException(404, "not served")
        model, fn = route
        try:
            raw = await body_of(request) if request.method == "POST" else b"{}"
            parsed = raw if model is bytes else parse_json(raw, model)
            result = fn(parsed, *extra)
            if asyncio.iscoroutine(result):
                result = await result
        except UserError as exc:
            status = 413 if isinstance(exc, TooLarge) else 400
            refuse(request, status, " ".join(exc.problems))
            return JSONResponse({"detail": " ".join(exc.problems)}, status_code=status)
        except TimeoutError:
            refuse(request, 408, "the body was late")
            return JSONResponse({"detail": f"the body did not arrive within {http.body_timeout_s} s"}, status_code=408)
        return answer(result)

    @app.api_route("/api/v1/{name:path}", methods=["GET", "POST"])
    async def route(request: Request, name: str) -> Response:
        return await handle(request, name)

    return app


def _printable(text: str) -> str:
    """`text` with what is not printable escaped: a client's path or body cannot forge log lines."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
