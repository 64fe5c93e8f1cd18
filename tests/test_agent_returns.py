"""What agent programs and environments hand back is checked (agents/results.py) wherever it enters: a program's
return in process and from a worker process, an environment's step, a verifiers rubric's reward and metrics
(tests/test_verifiers_env.py). A value out of its type or range is that sample's error, counted; the run goes on."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from postrl.agents import results
from postrl.agents.loop.env import EnvCalls
from postrl.agents.endpoint.gateway import AgentGateway
from postrl.agents.programs.workers import BadFrame, parse_reply
from postrl.config import RolloutConfig
from postrl.rollout.base import SamplingParams
from test_agents import ScriptEngine, _prompt, tokenizer  # noqa: F401 - the module's fixture


class Loud:
    """A user's object whose repr and float raise: describing it must not run its code."""

    def __repr__(self):
        raise RuntimeError("repr ran")

    def __float__(self):
        raise RuntimeError("float ran")


HOSTILE = {  # a returned value: why it is refused (part of the message)
    "huge_int": (2**1024, "does not fit a float"),
    "huger_int": (10**5000, "does not fit a float"),  # past Python's int-to-str limit: no repr either
    "nan": (math.nan, "finite"),
    "inf": (math.inf, "finite"),
    "-inf": (-math.inf, "finite"),
    "past_bound": (1e300, "within +-1e+06"),
    "str": ("1.0", "must be a number"),
    "bool": (True, "must be a number"),
    "dict": ({"reward": {"nested": [1, {2: 3}]}}, "must be a number"),
    "list": ([1.0], "must be a number"),
    "object": (Loud(), "must be a number"),
}


def test_the_checker_takes_finite_bounded_numbers_and_refuses_the_rest_with_what_and_why():
    for value, expected in ((1, 1.0), (-0.5, -0.5), (np.float32(0.25), 0.25), (np.int64(3), 3.0), (1e6, 1e6)):
        assert results.reward(value) == expected and type(results.reward(value)) is float
    for name, (value, why) in HOSTILE.items():
        with pytest.raises(results.BadResult) as err:
            results.reward(value, "the agent's return")
        assert why in str(err.value) and str(err.value).startswith("the agent's return"), name
        assert len(str(err.value)) < 300 and "repr ran" not in str(err.value)
    assert results.metrics({"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}
    for bad, why in (({f"m{k}": 1.0 for k in range(10_000)}, "10000 names"), ({"a": {"b": 1}}, "['a'] is dict"),
                     ({"a": math.nan}, "finite"), ({7: 1.0}, "the name int 7"), ({"x" * 1000: 1.0}, "1 to 128"),
                     ([("a", 1.0)], "must be a dict")):  # fmt: skip
        with pytest.raises(results.BadResult, match=None) as err:
            results.metrics(bad)
        assert why in str(err.value), (why, str(err.value))
    assert results.text(None, "t") == "" and results.text("héllo", "t") == "héllo"
    for bad, why in ((b"bytes", "must be a str"), ({"role": "user"}, "must be a str"), (7, "must be a str"),
                     ("x" * (results.MAX_TEXT_CHARS + 1), "characters"), ("a\ud800b", "UTF-8")):  # fmt: skip
        with pytest.raises(results.BadResult) as err:
            results.text(bad, "the observation")
        assert why in str(err.value)
    assert results.error_text(ValueError(2**100_000)) == "ValueError: <its message cannot be shown>"


def test_a_worker_frame_with_a_number_out_of_range_is_a_bad_frame_of_that_worker():
    """The worker checks a program's return before sending it (an error frame then), so a number out of range in an
    ok frame means the worker itself is broken: a bad frame, which restarts it (issue 60: the sender restarted)."""
    for raw in ('["k", "ok", NaN]', '["k", "ok", Infinity]', '["k", "ok", 1e400]', '["k", "ok", 1e300]'):
        with pytest.raises(BadFrame, match="out of range"):
            parse_reply(json.loads(raw))
    assert parse_reply(json.loads('["k", "ok", 0.5]')) == ("k", "ok", 0.5)


AGENT = '''
import math


class Loud:
    def __repr__(self):
        raise RuntimeError("repr ran")


RETURNS = {{"ok": 0.5, "none": None, "huge_int": 2**1024, "huger_int": 10**5000, "nan": math.nan, "inf": math.inf,
           "past_bound": 1e300, "str": "1.0", "dict": {{"reward": {{"nested": [1]}}}}, "object": Loud()}}


class Unshowable(Exception):
    def __str__(self):
        raise RuntimeError("str ran")


def run(client, row):
    client.chat.completions.create(model=client.model, messages=[{{"role": "user", "content": "hi"}}], max_tokens=2)
    if row["kind"] == "unshowable":
        raise Unshowable()  # its message is read on the engine thread: it must not raise there
    return RETURNS[row["kind"]]
'''
KINDS = ["ok", "none", "huge_int", "huger_int", "nan", "inf", "past_bound", "str", "dict", "object", "unshowable"]


@pytest.mark.parametrize("workers", [0, 1])
def test_hostile_returns_of_a_program_in_process_and_in_a_worker_are_each_samples_counted_error(tokenizer, tmp_path, workers):
    path = tmp_path / "returns_agent.py"
    path.write_text(AGENT.format())
    cfg = RolloutConfig(agent=f"{path}:run", agent_timeout_s=60, agent_workers=workers, agent_batch_wait_ms=5)
    gw = AgentGateway(ScriptEngine(tokenizer, ["\\boxed{1}<|im_end|>"] * 20), tokenizer, cfg)
    try:
        out = gw.generate([_prompt(tokenizer)] * len(KINDS), SamplingParams(max_tokens=20, greedy=True), rows=[{"kind": k} for k in KINDS])
        m = gw.pop_metrics()
        again = gw.generate([_prompt(tokenizer)], SamplingParams(max_tokens=20, greedy=True), rows=[{"kind": "ok"}])  # the run goes on
    finally:
        gw.close()
    assert [c.env_reward for c in out] == [0.5] + [0.0] * (len(KINDS) - 1)
    assert [sum(c.loss_mask) > 0 for c in out] == [True, True] + [False] * (len(KINDS) - 2)  # a failed sample trains nothing
    assert (m["agent/errors"], m["agent/timeouts"], m["agent/internal_errors"]) == (len(KINDS) - 2, 0, 0)
    assert again[0].env_reward == 0.5


class Hostile:
    """An environment whose step returns the row's value in one of its three places."""

    def reset(self, row):
        self.out = row["out"]

    def step(self, text):
        return self.out


def test_an_environment_step_out_of_type_or_range_is_counted_invalid_and_never_raises():
    calls, env = EnvCalls("tests:Hostile"), Hostile()
    bad = [("obs", 2**1024, True), ("obs", math.nan, True), ("obs", "1", True), ("obs", {"r": 1}, True),
           ({"role": "user"}, 1.0, True), ("x" * (results.MAX_TEXT_CHARS + 1), 1.0, True), ("\udc80", 1.0, True),
           ("obs", 1.0, "no"), ("obs", 1.0, None)]  # fmt: skip
    for out in bad:
        env.reset({"out": out})
        assert calls.step(env, "text") is None, out
    env.reset({"out": ("obs", np.float32(0.5), np.bool_(False))})
    assert calls.step(env, "text") == ("obs", 0.5, False)
    assert calls.pop_metrics() == {"agent/env_errors": 0.0, "agent/env_invalid": float(len(bad))}


class Unshowable(Exception):
    def __str__(self):
        raise RuntimeError("str ran")


def _surrogate(expression: str) -> str:
    return "a\ud800b"


def _giant(expression: str) -> int:
    return 10**5000


def _unshowable(expression: str) -> str:
    raise Unshowable()


def test_a_user_tools_hostile_return_or_error_is_that_calls_text_and_never_raises():
    from postrl.agents.tools.tools import Tool, call_tool

    schema = {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
    for fn, status, text in ((_surrogate, "ok", "a?b"), (_giant, "error", "ValueError: "), (_unshowable, "error", "Unshowable: <its message cannot be shown>")):
        r = call_tool({"t": Tool("t", schema, fn, "tests:t")}, "t", {"expression": "1"})
        assert (r.status, r.text.startswith(text)) == (status, True), (fn.__name__, r)
        r.text.encode("utf-8")  # what the tokenizer gets
