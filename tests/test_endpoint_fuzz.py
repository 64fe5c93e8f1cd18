"""Property-based fuzzing of the live rollout endpoint (agents/endpoint/server.py, agents/endpoint/schema.py, agents/endpoint/scheduler.py).

Thousands of generated bodies, each a well-formed chat or completions request with one to three faults
(a value of the wrong type at any field, deep nesting, huge values, unknown fields, a field dropped) or
raw garbage, go to a live endpoint over the HF engine on the tiny model. Each must be answered 2xx or
with an OpenAI-shaped 4xx (never a 5xx: that would be a fault of ours, contained); the engine thread
stays alive; the program's next well-formed request is answered; the process's memory stays bounded.
"""

from __future__ import annotations

import json
import os

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from endpoint_for_tests import live

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]  # fmt: skip
CHAT = {
    "model": "m", "n": 1, "max_tokens": 2, "stop": ["\n\n"], "temperature": 1.0, "top_p": 1.0, "logprobs": True,
    "top_logprobs": 0, "stream": False, "tools": TOOLS, "tool_choice": "auto",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is 1 + 1?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1 + 1"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ],
}  # fmt: skip
COMPLETION = {"model": "m", "prompt": "What is", "n": 1, "max_tokens": 2, "stop": "x", "logprobs": 1}
EXAMPLES = 2000


def paths(value, at=()):
    """Every path into a JSON value (dict keys and list indices), the root's own included."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*at, i))


CHAT_PATHS, COMPLETION_PATHS = [p for p in paths(CHAT) if p], [p for p in paths(COMPLETION) if p]
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
    st.sampled_from([10**40, -(10**40), -1, 0, 2**63, 1e308, "", "x" * 100_000, " " * 5000]),
)  # fmt: skip
values = st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=10)
huge = st.sampled_from([["x"] * 5000, [0] * 50_000, [{"type": "text", "text": "y"}] * 2000, {"k" * 1000: 1}, list(range(10**5, 10**5 + 3000))])
deep = st.builds(lambda d, kind: ("DEEP", d, kind), st.integers(1, 5000), st.sampled_from(["[", "{"]))
mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10**6), st.one_of(values, huge, deep)),
    st.tuples(st.just("drop"), st.integers(0, 10**6), st.none()),
    st.tuples(st.just("unknown"), st.integers(0, 10**6), st.tuples(st.text(min_size=1, max_size=10), values)),
)  # fmt: skip
requests = st.one_of(
    st.tuples(st.sampled_from(["chat", "completions"]), st.lists(mutation, min_size=1, max_size=3)),
    st.tuples(st.sampled_from(["chat", "completions"]), st.binary(max_size=64)),  # garbage
    st.tuples(st.just("truncated"), st.integers(1, 400)),
)  # fmt: skip


def render(request) -> tuple[str, bytes]:
    """(route, body bytes) of a generated request."""
    kind, how = request
    if kind == "truncated":
        return "chat/completions", json.dumps(CHAT).encode()[: how]
    route = "chat/completions" if kind == "chat" else "completions"
    if isinstance(how, bytes):
        return route, how
    body, where, raw = json.loads(json.dumps(CHAT if kind == "chat" else COMPLETION)), CHAT_PATHS if kind == "chat" else COMPLETION_PATHS, {}
    for op, k, value in how:
        path = where[k % len(where)]
        parent = body
        try:
            for step in path[:-1]:
                parent = parent[step]
            if op == "set":
                if isinstance(value, tuple):  # deep nesting, spliced in as raw JSON
                    marker = f"__DEEP{len(raw)}__"
                    d, bracket = value[1], value[2]
                    raw[f'"{marker}"'] = "[" * d + "]" * d if bracket == "[" else '{"a": ' * d + "1" + "}" * d
                    value = marker
                parent[path[-1]] = value
            elif op == "drop":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[value[0]] = value[1]
            else:
                body[value[0]] = value[1]
        except (KeyError, IndexError, TypeError):  # an earlier mutation changed the path's shape
            continue
    text = json.dumps(body)
    for marker, nested in raw.items():
        text = text.replace(marker, nested)
    return route, text.encode()


def test_thousands_of_generated_bodies_each_get_an_answer_and_the_endpoint_lives_on():
    proc = psutil.Process(os.getpid())
    statuses: dict[int, int] = {}
    with live(max_tokens=16) as lv, httpx.Client(timeout=60) as http:
        rss: list[int] = []

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(requests)
        def answered(request):
            route, body = render(request)
            r = http.post(f"{lv.url}/{route}", content=body, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 413), (r.status_code, r.text[:300], body[:300])
            out = r.json()
            if r.status_code == 200:
                assert out["object"] in ("chat.completion", "text_completion") and out["choices"]
            else:
                assert set(out["error"]) == {"message", "type", "param", "code"} and out["error"]["message"]
            assert lv.thread.is_alive()
            if sum(statuses.values()) == 300:  # past the warm-up (caches, first renders)
                rss.append(proc.memory_info().rss)

        answered()
        rss.append(proc.memory_info().rss)
        m = lv.gateway.pop_metrics()
    assert lv.last["status"] == 200  # the next well-formed request, after them all
    assert sum(statuses.values()) >= EXAMPLES and statuses.get(200, 0) > 20 and statuses.get(400, 0) > EXAMPLES // 2, statuses
    assert m["agent/internal_errors"] == 0 and m["agent/bad_requests"] == sum(n for s, n in statuses.items() if s != 200)
    assert rss[-1] - rss[0] < 200 * 2**20, f"RSS grew {(rss[-1] - rss[0]) / 2**20:.0f} MiB over the fuzzing"
