"""The OpenAI-compatible HTTP endpoint in front of the rollout engine (FastAPI + uvicorn, loopback).

    POST /s/<session>/v1/chat/completions    messages, tools, tool_choice, n, temperature, top_p,
                                             max_tokens / max_completion_tokens, stop, logprobs
    POST /s/<session>/v1/completions         prompt (text or token ids), n, max_tokens, stop, logprobs
    GET  /s/<session>/v1/models

The same routes without `/s/<session>` take the session from the API key (`Authorization: Bearer
<session>`), for programs whose base_url is fixed. The HTTP side only parses JSON and queues the
request; everything that touches the tokenizer, the sessions and the engine runs on the thread that
called `AgentGateway.generate` (agents/gateway.py): one engine thread, batches of concurrent requests.
A request that is not well formed gets the OpenAI error shape (status 400), never a crash.

Sampling follows the run, not the request: the engine samples at `rollout.temperature / top_p / top_k`
(greedy in validation) whatever the program asks, because the trainer's log-probs and the rollout
correction assume that distribution; `max_tokens` is honoured within the trajectory's budget
(`rollout.max_tokens` across its requests), `n` and `stop` are honoured.
"""

# no `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request) at runtime

import asyncio
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from postrl.agents.session import Session, norm_content, same_message


class BadRequest(Exception):
    """A request the endpoint answers with the OpenAI error shape (HTTP 400 unless `status` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Pending:
    """One HTTP request waiting for the engine thread; `reply` hands the answer back to the server's loop."""

    kind: str  # chat | completions
    session: Session
    body: dict
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)

    def reply(self, status: int, body: dict) -> None:
        def put() -> None:
            if not self.future.done():
                self.future.set_result((status, body))

        self.loop.call_soon_threadsafe(put)


@dataclass
class Job:
    """A prepared request: the prompt ids and what to sample."""

    pending: Pending
    prompt: list[int]
    n: int
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    tools: list | None = None
    messages: list[dict] | None = None


def make_app(hub: Any) -> Any:
    """The FastAPI app; `hub` has `session(key) -> Session | None`, `submit(Pending)` and `model_name`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="postrl rollout endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def session_of(key: str | None, auth: str = "") -> Session | BadRequest:
        if key is None:
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        s = hub.session(key) if key else None
        if s is None:
            return BadRequest(f"unknown session '{key}': use the base_url (or API key) postrl gave this sample", status=404)
        if s.closed:
            return BadRequest(f"session '{key}' is closed (its sample ended or ran out of time)", status=410)
        return s

    async def post(kind: str, key: str | None, auth: str, raw: bytes) -> tuple[int, dict]:
        s = session_of(key, auth)
        if isinstance(s, BadRequest):
            return s.status, error_body(s.message)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            s.bad_requests += 1
            return 400, error_body(f"the body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            s.bad_requests += 1
            return 400, error_body("the body must be a JSON object")
        loop = asyncio.get_running_loop()
        pending = Pending(kind, s, body, loop, loop.create_future())
        hub.submit(pending)
        return await pending.future

    async def fast(scope: dict, receive: Any, send: Any) -> None:
        """The sampling routes as plain ASGI (the hot path: every model call of every program; FastAPI's routing
        and request objects cost about as much as the rest of the server's work per request); the others,
        and any path that is not one of these, go to FastAPI."""
        m = _POST_ROUTE.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if m is None:
            return await app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        status, out = await post("completions" if m["kind"] == "completions" else "chat", m["key"], auth, b"".join(chunks))
        payload = json.dumps(out).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    def models(request: Request, key: str | None) -> JSONResponse:
        s = session_of(key, request.headers.get("authorization", ""))
        if isinstance(s, BadRequest):
            return JSONResponse(error_body(s.message), status_code=s.status)
        return JSONResponse({"object": "list", "data": [{"id": hub.model_name, "object": "model", "created": 0, "owned_by": "postrl"}]})

    for prefix in ("/s/{key}/v1", "/v1"):
        def routes(prefix: str = prefix) -> None:
            @app.get(prefix + "/models")
            async def list_models(request: Request, key: str | None = None) -> JSONResponse:
                return models(request, key)

        routes()
    return fast


_POST_ROUTE = re.compile(r"(?:/s/(?P<key>[^/]+))?/v1/(?P<kind>chat/completions|completions)/?")


class Server:
    """uvicorn serving `app` on a background thread with its own event loop; `port` 0 picks a free one."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without it Nagle holds a response's body behind its headers until the
        # client's delayed ACK, ~40 ms per request on a kept-alive connection (measured 45 ms -> 1 ms)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=60)
        self.server = uvicorn.Server(config)
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
        return f"http://{self.host}:{self.port}/s/{key}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()


# ------------------------------------------------------------------------------------ requests
def _int(body: dict, name: str, lo: int, default: int | None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"'{name}' must be an integer >= {lo}, got {v!r}", name)
    return v


def _common(body: dict) -> tuple[int, int | None, list[str], bool]:
    n = _int(body, "n", 1, 1)
    max_tokens = _int(body, "max_completion_tokens", 1, None) or _int(body, "max_tokens", 1, None)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a string or a list of non-empty strings", "stop")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise BadRequest(f"'{name}' must be a number, got {v!r}", name)
    if body.get("stream"):
        raise BadRequest("streaming is not supported by the rollout endpoint; send stream: false", "stream")
    lp = body.get("logprobs")
    return n, max_tokens, stop, bool(lp) if not isinstance(lp, int) or isinstance(lp, bool) else lp > 0


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}] must be an object with a role of system, user, assistant or tool", f"messages[{i}]")
        try:
            norm_content(m.get("content"))
        except ValueError as exc:
            raise BadRequest(f"messages[{i}]: {exc}", f"messages[{i}].content") from None
        out.append(m)
    return out


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function", t).get("name"), str) for t in tools):
        raise BadRequest("'tools' must be a list of {type: function, function: {name, description, parameters}}", "tools")
    return tools or None


def template_messages(messages: list[dict], session: Session) -> list[dict]:
    """The program's messages as chat templates take them: text content, tool calls with JSON-object
    arguments, tool results named after their call (Hermes templates ignore the id)."""
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        t: dict = {"role": role, "content": norm_content(m.get("content"))}
        if m.get("tool_calls"):
            from postrl.agents.session import norm_tool_calls

            t["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in norm_tool_calls(m["tool_calls"])]
        if role == "tool":
            t["name"] = m.get("name") or session.tool_names.get(m.get("tool_call_id", ""), "tool")
        out.append(t)
    return out


def prepare(p: Pending, renderer: Any, tokenizer: Any, cache: dict | None = None) -> Job:
    """The request's prompt ids; a chat that extends the session's last one reuses that one's ids (session.py).
    `cache` (the template's ids of whole chats, by their messages and tools) spares rendering the same first
    request again: the n samples of a prompt all start with it (~1 ms each for a chat with tools)."""
    body, s = p.body, p.session
    n, max_tokens, stop, logprobs = _common(body)
    if p.kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(tokenizer) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")
        return Job(p, ids, n, max_tokens, stop, logprobs)
    messages, tools = _messages(body), _tools(body)
    ids = _continuation(s, messages, tools, renderer)
    if ids is None:
        shown = template_messages(messages, s)
        key = json.dumps([shown, tools], sort_keys=True, default=str) if cache is not None else None
        ids = cache.get(key) if cache is not None else None
        if ids is None:
            try:
                ids = tokenizer.apply_chat_template(shown, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as exc:  # the template refused these messages (its own raise_exception, a bad shape)
                raise BadRequest(f"the model's chat template cannot render these messages: {exc}", "messages") from None
            if cache is not None:
                if len(cache) >= 4096:
                    cache.clear()
                cache[key] = list(ids)
    return Job(p, list(ids), n, max_tokens, stop, logprobs, tools=tools, messages=messages)


def _continuation(s: Session, messages: list[dict], tools: list | None, renderer: Any) -> list[int] | None:
    """Ids of a chat that is the last one + an assistant message returned + new messages: the last ids, then
    only the new messages rendered (never the assistant's text re-tokenised); None when it is not."""
    last = s.last_messages
    if last is None or tools != s.last_tools or len(messages) <= len(last) + 1:
        return None
    if not all(same_message(a, b) for a, b in zip(messages, last)):
        return None
    for choice in s.tips:
        if choice.message is not None and same_message(messages[len(last)], choice.message):
            new = template_messages(messages[len(last) + 1 :], s)
            if new[-1]["role"] == "assistant":
                return None  # a prefilled assistant turn: rendered whole
            try:
                return choice.full + renderer.after_turn(new, choice.full[-1])
            except Exception:
                return None
    return None


def respond(job: Job, choices: list[tuple[list[int], list[float] | None, str]], tokenizer: Any, eos_ids: set[int], model: str) -> dict:
    """The OpenAI response body for sampled choices [(ids, log-probs, finish_reason)]; records tool call ids."""
    from postrl.agents.parse import ParseError, parse_tool_calls

    created = int(time.time())
    out = []
    prompt_tokens, completion_tokens = len(job.prompt), 0
    for k, (ids, lps, finish) in enumerate(choices):
        completion_tokens += len(ids)
        text = tokenizer.decode([t for t in ids if t not in eos_ids], skip_special_tokens=False)
        for s in job.stop:
            if s in text:
                text = text[: text.index(s)]
        entry: dict = {"index": k, "finish_reason": finish, "logprobs": None}
        if job.logprobs and lps is not None:
            entry["logprobs"] = {"content": [
                {"token": tokenizer.decode([t]), "logprob": float(lp), "bytes": None, "top_logprobs": []} for t, lp in zip(ids, lps)
            ]}  # fmt: skip
        if job.pending.kind == "completions":
            entry["text"] = text
        else:
            message: dict = {"role": "assistant", "content": text}
            if job.tools:
                parsed = parse_tool_calls(text, None)
                if not isinstance(parsed, ParseError) and parsed:
                    calls = []
                    for c in parsed:
                        cid = f"call_{uuid.uuid4().hex[:16]}"
                        job.pending.session.tool_names[cid] = c.name
                        calls.append({"id": cid, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
                    content = _outside_calls(text)
                    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    if finish == "stop":
                        entry["finish_reason"] = "tool_calls"
            entry["message"] = message
        out.append(entry)
    kind = "text_completion" if job.pending.kind == "completions" else "chat.completion"
    return {
        "id": f"postrl-{uuid.uuid4().hex[:24]}", "object": kind, "created": created, "model": model, "choices": out,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip


def cut_at_stop(tokenizer: Any, ids: list[int], stops: list[str]) -> tuple[list[int], bool]:
    """The ids through the token that completes the first stop string (the program sees the text before it)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if not any(s in text for s in stops):
        return ids, False
    for k in range(1, len(ids) + 1):
        if any(s in tokenizer.decode(ids[:k], skip_special_tokens=False) for s in stops):
            return ids[:k], True
    return ids, False


def _outside_calls(text: str) -> str:
    from postrl.agents.parse import _BLOCK

    return _BLOCK.sub("", text).strip()
