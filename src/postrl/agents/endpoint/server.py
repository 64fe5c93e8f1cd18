"""The endpoint's HTTP side: uvicorn on a thread of its own, the ASGI app, and what it refuses before any work.

    POST /s/<session>/v1/chat/completions    POST /s/<session>/v1/completions    GET /s/<session>/v1/models

(the same without `/s/<session>` take the session from `Authorization: Bearer <session>`). Per request, in
this order, each refusal OpenAI-shaped and counted (`Tally`, the gateway's `agent/bad_requests`):

- a connection beyond `rollout.agent_max_connections` open at once: 503, closed;
- a request whose headers are not complete `rollout.agent_header_timeout_s` after its first byte (or, on a
  kept-alive connection, whose first byte does not come that long after the last answer): closed;
- an answer the client does not take within `rollout.agent_body_timeout_s` of its start: the connection aborted;
- headers over `HttpLimits.max_header_bytes` (h11's incomplete-event cap: 400, closed) or more than
  `HttpLimits.max_headers` of them: 431; a protocol upgrade (WebSocket, h2c) is not taken: the request is
  answered as plain HTTP/1.1 on the same connection, so the connection stays the gate's to count and close;
- an unknown session: 404 (a sample that already ended: 410, not counted), before the body is read;
- a `Content-Length` above `rollout.agent_max_body_bytes`: 413, before the body is read (a chunked body
  that grows past it: 413 when it does); a body not in within `rollout.agent_body_timeout_s`: 408;
- a body that is not JSON, nests deeper than `rollout.agent_max_json_depth`, or does not fit the OpenAI
  schema and the run's limits (agents/endpoint/schema.py): 400 with the field named.

Only then is the request queued (`Pending`) for the engine thread (agents/endpoint/scheduler.py), which answers it.
Anything unexpected while handling a request is a 500 for that request, never the server's end. A response
sent before its request's body was read closes the connection (the rest of that body holds no slot).

The HTTP implementation is pinned to uvicorn's h11 protocol, not `auto` (httptools where installed): the
header cap above is h11's, and httptools has none.
"""

# no `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request) at runtime

import asyncio
import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from postrl.agents.endpoint.schema import BadRequest, Limits, Request, error_body, parse
from postrl.agents.session import Session


class Tally:
    """A count several threads add to (the server's loop, the engine thread); `pop` reads and resets it."""

    def __init__(self) -> None:
        self._n, self._lock = 0, threading.Lock()

    def add(self, n: int = 1) -> None:
        with self._lock:
            self._n += n

    def pop(self) -> int:
        with self._lock:
            n, self._n = self._n, 0
            return n


@dataclass(frozen=True)
class HttpLimits:
    """What the HTTP side enforces (rollout.agent_*)."""

    max_body_bytes: int = 8 * 2**20
    max_connections: int = 1024
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 16 * 2**10  # an OpenAI client sends under 1 KiB
    max_headers: int = 100

    @classmethod
    def of(cls, cfg: Any) -> "HttpLimits":
        return cls(cfg.agent_max_body_bytes, cfg.agent_max_connections, cfg.agent_header_timeout_s, cfg.agent_body_timeout_s)


@dataclass
class Pending:
    """One parsed request waiting for the engine thread; `reply` hands the answer back to the server's loop."""

    session: Session
    request: Request
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)

    @property
    def kind(self) -> str:
        return self.request.kind

    def reply(self, status: int, body: dict) -> None:
        def put() -> None:
            if not self.future.done():
                self.future.set_result((status, body))

        self.loop.call_soon_threadsafe(put)


_POST_ROUTE = re.compile(r"(?:/s/(?P<key>[^/]+))?/v1/(?P<kind>chat/completions|completions)/?")


def make_app(hub: Any, limits: Limits, http: HttpLimits, refused: Tally, gate: "Gate | None" = None) -> Any:
    """The ASGI app; `hub` has `session(key) -> Session | None`, `submit(Pending)` and `model_name`."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse

    from starlette.exceptions import HTTPException

    app = FastAPI(title="postrl rollout endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:  # an unknown path, a wrong method
        refused.add()
        message = f"{request.method} {request.url.path}: {exc.detail} (the endpoint serves /v1/chat/completions, /v1/completions, /v1/models)"
        return JSONResponse(error_body(message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        refused.add()
        return JSONResponse(error_body(f"the endpoint failed on this request: {type(exc).__name__}"[:500], kind="server_error"), status_code=500)

    def session_of(key: str | None, auth: str) -> Session:
        if key is None:
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        s = hub.session(key) if key else None
        if s is None:
            raise BadRequest(f"unknown session '{key}': use the base_url (or API key) postrl gave this sample", status=404)
        if s.closed:
            raise BadRequest(f"session '{key}' is closed (its sample ended or ran out of time)", status=410)
        return s

    async def read_body(scope: dict, receive: Any) -> bytes | None:
        """The body, within the size and time limits; None if the client went away."""
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > http.max_body_bytes):
            raise BadRequest(f"the body is over {http.max_body_bytes} bytes (rollout.agent_max_body_bytes)", status=413)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(http.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > http.max_body_bytes:
                        raise BadRequest(f"the body is over {http.max_body_bytes} bytes (rollout.agent_max_body_bytes)", status=413)
                    chunks.append(chunk)
                    if not message.get("more_body"):
                        return b"".join(chunks)
        except TimeoutError:
            raise BadRequest(f"the body did not arrive within {http.body_timeout_s} s (rollout.agent_body_timeout_s)", status=408) from None

    async def post(kind: str, key: str | None, scope: dict, receive: Any) -> tuple[int, dict] | None:
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        s = None
        try:
            s = session_of(key, auth)
            raw = await read_body(scope, receive)
            if raw is None:
                return None
            request = parse(kind, raw, limits)
        except BadRequest as exc:
            if exc.status != 410:  # a late request of an ended sample is the program's race, not a bad request
                refused.add()
                if s is not None:
                    s.bad_requests += 1
            return exc.status, error_body(exc.message, exc.param)
        loop = asyncio.get_running_loop()
        pending = Pending(s, request, loop, loop.create_future())
        hub.submit(pending)
        return await pending.future

    async def fast(scope: dict, receive: Any, send: Any) -> None:
        """The sampling routes as plain ASGI (the hot path: every model call of every program; FastAPI's routing
        and request objects cost about as much as the rest of the server's work per request); the others,
        and any path that is not one of these, go to FastAPI."""
        m = _POST_ROUTE.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        try:
            if scope["type"] != "http":  # lifespan is off and upgrades are not taken: nothing else reaches here
                return None
            receive, send = _close_unless_read(scope, receive, send)
            if gate is not None:
                send = gate.started(scope.get("client"), send)
            if len(scope["headers"]) > http.max_headers:
                refused.add()
                message = f"the request has {len(scope['headers'])} headers; the endpoint takes at most {http.max_headers}"
                return await _answer(send, 431, error_body(message))
            if m is None:
                return await app(scope, receive, send)
            try:
                answer = await post("completions" if m["kind"] == "completions" else "chat", m["key"], scope, receive)
            except Exception as exc:  # a fault of ours on this request: its 500, never the server's end
                refused.add()
                answer = 500, error_body(f"the endpoint failed on this request: {type(exc).__name__}: {exc}"[:500], kind="server_error")
            if answer is not None:
                await _answer(send, *answer)
        finally:
            if gate is not None and scope["type"] == "http":
                gate.done(scope.get("client"))

    def models(request: HttpRequest, key: str | None) -> JSONResponse:
        try:
            session_of(key, request.headers.get("authorization", ""))
        except BadRequest as exc:
            if exc.status != 410:
                refused.add()
            return JSONResponse(error_body(exc.message), status_code=exc.status)
        return JSONResponse({"object": "list", "data": [{"id": hub.model_name, "object": "model", "created": 0, "owned_by": "postrl"}]})

    for prefix in ("/s/{key}/v1", "/v1"):
        def routes(prefix: str = prefix) -> None:
            @app.get(prefix + "/models")
            async def list_models(request: HttpRequest, key: str | None = None) -> JSONResponse:
                return models(request, key)

        routes()
    return fast


async def _answer(send: Any, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _close_unless_read(scope: dict, receive: Any, send: Any) -> tuple[Any, Any]:
    """`receive` and `send` such that a response that starts before the request's body was read all through says
    `connection: close`: the server closes the connection after it instead of waiting for the rest of a body
    nobody reads (a client trickling it would hold the connection with no deadline)."""
    headers = dict(scope["headers"])
    read = headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers

    async def receive_() -> dict:
        nonlocal read
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            read = True  # all of it, or the client is gone
        return message

    async def send_(message: dict) -> None:
        if message["type"] == "http.response.start" and not read:
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)

    return receive_, send_


class Gate:
    """The connections open at once (at most `max_connections`) and their header deadlines, on the server's loop."""

    def __init__(self, http: HttpLimits, refused: Tally):
        self.http, self.refused = http, refused
        self.open: dict[tuple, _Guarded] = {}
        body = json.dumps(error_body(
            f"the endpoint has {http.max_connections} connections open (rollout.agent_max_connections); retry later",
            kind="server_error", code="too_many_connections",
        )).encode()  # fmt: skip
        self.busy = (
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode() + body
        )

    def protocol(self, **kw: Any) -> "_Guarded":
        """uvicorn's protocol factory (its `http` setting): its own HTTP protocol for the connection, guarded."""
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return _Guarded(H11Protocol(**kw), self)

    def started(self, client: Any, send: Any) -> Any:
        """A request on the connection from `client` reached the app (a pipelined one too, which no byte announces):
        no deadline while the app works on it. Returns `send` such that its response, once started, must be taken
        by the client within `body_timeout_s` or the connection closes: a client that does not read (pipelined
        requests whose answers it never takes) would hold `send` on uvicorn's drain, and the connection, for ever."""
        guarded = self.open.get(tuple(client)[:2]) if client else None
        if guarded is not None:
            guarded.state = "body"
            guarded._disarm()

        async def send_(message: dict) -> None:
            if message["type"] == "http.response.start" and guarded is not None:
                guarded.state = "answering"
                guarded._arm(self.http.body_timeout_s)
            await send(message)

        return send_

    def done(self, client: Any) -> None:
        """A response was sent on the connection from `client`: it may wait `header_timeout_s` for its next request,
        as a new connection does (kept-alive connections that sent one request each and went quiet would otherwise
        hold every slot for uvicorn's keep-alive, a minute); that request's header clock restarts at its first byte."""
        guarded = self.open.get(tuple(client)[:2]) if client else None
        if guarded is not None:
            guarded.state = "idle"
            guarded._arm()


class _Guarded:
    """One connection: uvicorn's protocol (`inner`) behind the connection limit and the header deadline."""

    def __init__(self, inner: Any, gate: Gate):
        self.inner, self.gate = inner, gate
        self.transport: Any = None
        self.peer: tuple = ()
        self.timer: asyncio.TimerHandle | None = None
        # headers | body (the app has the request) | answering (its response is being sent) | idle (between requests)
        self.state, self.tail = "headers", b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if len(self.gate.open) >= self.gate.http.max_connections:
            self.gate.refused.add()
            transport.write(self.gate.busy)
            transport.close()
            self.inner = None
            return
        self.peer = tuple(transport.get_extra_info("peername") or ())[:2]
        self.gate.open[self.peer] = self
        try:
            self._arm()
            self.inner.connection_made(transport)
        except BaseException:  # the slot is released on every path
            self._disarm()
            del self.gate.open[self.peer]
            self.inner = None
            transport.close()
            raise

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.state == "idle":
            self.state, self.tail = "headers", b""
            self._arm()
        if self.state == "headers":
            seen = self.tail + data
            if b"\r\n\r\n" in seen:
                self.state = "body"
                self._disarm()
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> Any:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.gate.open.get(self.peer) is self:
            del self.gate.open[self.peer]
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def _arm(self, seconds: float | None = None) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds or self.gate.http.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        if self.state != "body":
            if self.state != "idle":  # a kept-alive connection that goes quiet is a client's right, not a refusal
                self.gate.refused.add()
            self.transport.abort()  # not close(), which waits to flush what a client that does not read never takes


class _Quiet(logging.Filter):
    """uvicorn's warnings on an `Upgrade:` it does not take: a client's choice, and the advice to install a
    WebSocket library is wrong here (the endpoint refuses them on purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Unsupported upgrade request", "No supported WebSocket library"))


class Server:
    """uvicorn serving `app` on a background thread with its own event loop; `port` 0 picks a free one."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, gate: Gate | None = None):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without it Nagle holds a response's body behind its headers until the
        # client's delayed ACK, ~40 ms per request on a kept-alive connection (measured 45 ms -> 1 ms)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.host, self.port, self.gate = host, self.sock.getsockname()[1], gate
        # h11, pinned (see the module's docstring); no WebSocket protocol, so an `Upgrade:` never takes the
        # connection away from the gate (a taken one never left it: enough of them locked every request out)
        http = gate.protocol if gate is not None else "h11"
        max_header_bytes = gate.http.max_header_bytes if gate is not None else HttpLimits.max_header_bytes
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=60, http=http,
                                ws="none", h11_max_incomplete_event_size=max_header_bytes)  # fmt: skip
        self.server = uvicorn.Server(config)
        quiet = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, _Quiet) for f in quiet.filters):
            quiet.addFilter(_Quiet())
        self.thread = threading.Thread(target=self._run, name="postrl-endpoint", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the rollout endpoint did not start on {host}:{self.port}")
            time.sleep(0.01)

    def _run(self) -> None:
        try:  # uvloop (installed with uvicorn[standard], vLLM): a faster loop for the server's per-request work
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            factory = None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(self.server.serve(sockets=[self.sock]))

    def url(self, key: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/s/{key}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
