"""The endpoint's limits and refusals (agents/endpoint/server.py, agents/endpoint/schema.py, agents/endpoint/scheduler.py), each
probed on a live endpoint over the HF engine on the tiny model: every refusal OpenAI-shaped and counted in
`agent/bad_requests`, and the engine thread answering the next well-formed request."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest
from pydantic import ValidationError

from postrl.agents.endpoint.answers import cut_at_stop
from postrl.config import RolloutConfig
from endpoint_for_tests import QUESTION, live, read_response, tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _post(url: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + "/chat/completions", content=content, headers={"content-type": "application/json"}, timeout=30, **kw)


def _error(r: httpx.Response) -> dict:
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


BAD_BODIES = {  # field named in the 400: body
    "messages.0.content.0.text": {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    "messages.0.content.0.text ": {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
    "tools.0.function": {"messages": QUESTION, "tools": [{"type": "function", "function": "calculator"}]},
    "messages.1.tool_calls": {"messages": QUESTION + [{"role": "assistant", "content": "", "tool_calls": 1}]},
    "messages.1.tool_call_id": {"messages": QUESTION + [{"role": "tool", "content": "5", "tool_call_id": ["a"]}]},
    "n": {"messages": QUESTION, "n": 9},  # rollout.n_samples_per_prompt is 8
    "stop": {"messages": QUESTION, "stop": ["x"] * 17},
    "stop ": {"messages": QUESTION, "stop": ["x" * 257]},
    "temperature": {"messages": QUESTION, "temperature": "hot"},
    "messages": {"messages": []},
}

ACCEPTED = [  # what real clients send: nulls for unset fields, fields the endpoint does not know, non-text parts
    {"messages": QUESTION, "n": None, "max_tokens": None, "temperature": None, "top_p": None, "stop": None, "tools": None,
     "tool_choice": None, "stream": False, "logprobs": None, "top_logprobs": None, "parallel_tool_calls": True,
     "stream_options": None, "response_format": {"type": "text"}, "seed": 1, "user": "u", "metadata": {}, "store": False},
    {"messages": [{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "2 + 3?"}, {"type": "image_url", "image_url": {"url": "x"}}]},
                  {"role": "assistant", "content": None, "refusal": None,
                   "tool_calls": [{"id": "c1", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "5"}]}],
     "tools": [{"name": "calculator", "parameters": {"type": "object"}}], "tool_choice": "required", "max_completion_tokens": 2},
]  # fmt: skip


def test_malformed_bodies_are_400_with_the_field_named_and_counted_and_the_next_request_is_answered():
    with live() as lv:
        for body in ACCEPTED:
            r = _post(lv.url, body)
            assert r.status_code == 200 and r.json()["choices"], r.text
        for field, body in BAD_BODIES.items():
            r = _post(lv.url, body)
            assert r.status_code == 400 and _error(r)["param"] == field.strip(), (field, r.text)
        deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 64 + b"]" * 64 + b"}"  # depth 65
        r = _post(lv.url, deep)
        assert r.status_code == 400 and "rollout.agent_max_json_depth" in _error(r)["message"]
        very = b"[" * 200_000 + b"]" * 200_000  # past Python's recursion limit
        assert _post(lv.url, very).status_code == 400
        ok = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": ' + b"[" * 62 + b"]" * 62 + b"}"  # depth 64
        r = _post(lv.url, ok)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        for method, route in (("GET", "/chat/completions"), ("POST", "/embeddings"), ("DELETE", "/models"), ("GET", "/../../x")):
            r = httpx.request(method, lv.url + route, timeout=30)  # not a route of the endpoint: its error shape all the same
            assert r.status_code in (404, 405) and _error(r)["type"] == "invalid_request_error", (method, route, r.text)
        m = lv.gateway.pop_metrics()
        assert lv.thread.is_alive()
    assert lv.last["status"] == 200
    assert m["agent/bad_requests"] == len(BAD_BODIES) + 2 + 4 and m["agent/internal_errors"] == 0


def test_the_body_size_is_checked_before_reading_the_body_and_the_session_before_that():
    with live(agent_max_body_bytes=4096) as lv:
        path = lv.url.split(lv.url.split("/")[2])[1]
        head = f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000000000\r\n\r\n"
        r = lv.raw(head.encode())  # no body is sent: the answer comes from the header alone
        assert r.startswith(b"HTTP/1.1 413") and b"rollout.agent_max_body_bytes" in r
        r = lv.raw(head.replace(path, path.replace("/s/", "/s/nobody")).encode())
        assert r.startswith(b"HTTP/1.1 404") and b"unknown session" in r
        chunked = f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode()
        r = lv.raw(chunked + b"1000\r\n" + b" " * 4096 + b"\r\n" + b"10\r\n" + b" " * 16 + b"\r\n0\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 413")
        assert lv.gateway.pop_metrics()["agent/bad_requests"] == 3
    assert lv.last["status"] == 200


def test_text_that_cannot_fit_the_context_is_refused_before_the_engine_thread_renders_it():
    from postrl.agents.endpoint.schema import longest_token_chars

    _, tok = tiny()
    bound = 512 * longest_token_chars(tok)  # live(): a 512-token context
    with live() as lv:
        over = {"messages": [{"role": "user", "content": "a " * (bound // 2 + 1)}]}  # + role, user, content: 15
        r = _post(lv.url, over)
        assert r.status_code == 400 and f"{bound + 2 + 15} characters of text" in _error(r)["message"], r.text
        tools = {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f", "description": "d" * (bound + 1)}}]}
        assert "characters of text" in _error(_post(lv.url, tools))["message"]
        under = {"messages": [{"role": "user", "content": "a " * 600}]}  # within the bound, past the context: the tokens decide
        r = _post(lv.url, under)
        assert r.status_code == 400 and "tokens; this run's context is 512" in _error(r)["message"]
        m = lv.gateway.pop_metrics()
        assert m["agent/bad_requests"] == 3 and m["agent/engine_calls"] == 0
    assert lv.last["status"] == 200


def _wait_open(lv, n: int) -> None:
    """Until the server's loop has seen the connections open come to `n` (a condition, polled)."""
    deadline = time.monotonic() + 30
    while len(lv.gateway._server.gate.open) != n:
        assert time.monotonic() < deadline, f"{len(lv.gateway._server.gate.open)} connections open, not {n}"
        time.sleep(0.01)


def test_connections_at_once_and_slow_headers_and_bodies_are_refused():
    with live(agent_max_connections=3, agent_concurrency=1, agent_header_timeout_s=0.5, agent_body_timeout_s=0.5) as lv:
        path = lv.url.split(lv.url.split("/")[2])[1]
        # three idle connections fill the endpoint; a fourth is answered 503 (OpenAI-shaped) and closed
        held = [socket.create_connection(lv.host_port, timeout=30) for _ in range(3)]
        _wait_open(lv, 3)
        r = lv.raw(b"")
        body = json.loads(r.partition(b"\r\n\r\n")[2])
        assert r.startswith(b"HTTP/1.1 503") and body["error"]["code"] == "too_many_connections"
        # the idle three sent nothing for longer than the header timeout: closed by the server
        assert [read_response(s) for s in held] == [b""] * 3
        _wait_open(lv, 0)
        # a slow client: half its headers, then nothing; closed after the header timeout, no answer
        slow = socket.create_connection(lv.host_port, timeout=30)
        slow.sendall(f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\n".encode())
        assert read_response(slow) == b""
        slow.close()
        # a body that never completes: 408
        r = lv.raw(f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{{".encode())
        assert r.startswith(b"HTTP/1.1 408") and b"rollout.agent_body_timeout_s" in r
        for s in held:
            s.close()
        assert lv.gateway.pop_metrics()["agent/bad_requests"] == 1 + 3 + 1 + 1
    assert lv.last["status"] == 200


def test_one_token_budget_per_trajectory_across_its_segments():
    with live(max_tokens=8) as lv:
        sampled = 0
        for k in range(4):  # each request an unrelated chat: a new segment each time
            r = _post(lv.url, {"messages": [{"role": "user", "content": f"question {k}"}], "max_tokens": 5})
            assert r.status_code == 200
            sampled += r.json()["usage"]["completion_tokens"]
        last = r.json()["choices"][0]
    assert sampled <= 8 and sampled >= 5  # the first request sampled up to 5; the budget (8) holds across segments
    assert last["finish_reason"] == "length"


def test_an_unexpected_failure_on_the_engine_thread_is_that_requests_500_and_the_thread_goes_on():
    with live() as lv:
        sched = lv.gateway.scheduler
        real = sched.shaper

        class Broken:  # the answer shaping fails once (a bug of ours): that request alone is answered 500
            def __getattr__(self, name):
                return getattr(real, name)

            def answer(self, *a):
                sched.shaper = real
                raise KeyError("a bug")

        sched.shaper = Broken()
        r = _post(lv.url, {"messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 500 and _error(r)["type"] == "server_error" and "KeyError" in _error(r)["message"]
        assert _post(lv.url, {"messages": QUESTION, "max_tokens": 2}).status_code == 200
        engine = sched.engine

        class Failing:  # the engine raises on one call: that call's requests are answered 500
            def __getattr__(self, name):
                return getattr(engine, name)

            def generate(self, *a, **kw):
                sched.engine = engine
                raise RuntimeError("device lost")

        sched.engine = Failing()
        r = _post(lv.url, {"messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 500 and "device lost" in _error(r)["message"]
        assert _post(lv.url, {"messages": QUESTION, "max_tokens": 2}).status_code == 200
        m = lv.gateway.pop_metrics()
        assert lv.thread.is_alive()
    assert (m["agent/internal_errors"], m["agent/bad_requests"]) == (2, 2) and lv.last["status"] == 200


def test_a_non_loopback_host_needs_the_opt_in_and_then_warns_at_every_start(caplog):
    with pytest.raises(ValidationError, match="rollout.agent_allow_remote"):
        RolloutConfig(agent="x:y", agent_host="0.0.0.0")
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        RolloutConfig(agent="x:y", agent_host=host)
    caplog.set_level(logging.WARNING, logger="postrl")
    for _ in range(2):
        with live(agent_host="0.0.0.0", agent_allow_remote=True) as lv:
            pass
        assert lv.last["status"] == 200
    assert sum("rollout.agent_allow_remote" in r.getMessage() for r in caplog.records) == 2


def test_cut_at_stop_finds_the_first_stop_in_logarithmically_many_decodes():
    _, tok = tiny()
    ids = tok("one two three four five six seven eight nine ten " * 20, add_special_tokens=False)["input_ids"]
    calls = []

    class Counting:
        def decode(self, x, **kw):
            calls.append(len(x))
            return tok.decode(x, **kw)

    for stop in (["seven"], ["six sev", "four"], ["ten one"], ["absent"]):
        calls.clear()
        got, hit = cut_at_stop(Counting(), ids, stop)
        want = next((k for k in range(1, len(ids) + 1) if any(s in tok.decode(ids[:k]) for s in stop)), None)
        assert (got, hit) == ((ids[:want], True) if want else (ids, False))
        assert len(calls) <= 2 + len(ids).bit_length()  # bisection, not a decode per token
