"""The verifier pool trusts nothing a worker sends: replies are capped JSON frames in a declared shape, never
unpickled; a bad frame ends its worker (replaced), its call is an error, the next call scores as before."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import postrl.rewards.pool as pool_module
import verifiers_hostile
from postrl.rewards import VerifierResult, get_verifier
from postrl.rewards.pool import MAX_REPLY_BYTES, BadReply, Call, Outcome, Ready, VerifierPool, encode_reply, parse_frame


@pytest.fixture(scope="module")
def pool():
    p = VerifierPool(workers=1, timeout_s=30.0)
    yield p
    p.close()


def math_verify_call() -> Call:
    return Call(get_verifier("math_verify"), r"The answer is $\boxed{\frac{1}{2}}$", "0.5", {})


@pytest.mark.parametrize(
    "kind, why",
    [
        ("pickle", "Invalid JSON"),
        ("garbage", "Invalid JSON"),
        ("oversize", f"a frame of {MAX_REPLY_BYTES + 1} bytes (at most {MAX_REPLY_BYTES})"),
        ("score_str", "Input should be a valid number at reply.result.score"),
        ("metrics_list", "at reply.result.metrics"),
        ("other_task", "a reply for task 1000, while the worker was given 0"),
        ("cut_short", "a frame cut short (1 of 10000 bytes arrived in time)"),
    ],
)
def test_a_malformed_reply_ends_its_worker_and_is_never_unpickled(pool, tmp_path, monkeypatch, kind, why):
    monkeypatch.setattr(pool_module, "FRAME_TIMEOUT_S", 0.5)  # `cut_short` waits this long for the rest
    marker = tmp_path / "unpickled"
    restarts, malformed = pool.restarts, pool.malformed_replies
    bad, good = pool.run([Call(verifiers_hostile.sends, kind, str(marker), {"max_bytes": MAX_REPLY_BYTES}), math_verify_call()])
    assert not marker.exists(), "the trainer ran code from a worker's frame"
    assert bad.status == "error" and bad.result is None
    assert bad.message.startswith("verifier worker sent a malformed reply: ") and why in bad.message, bad.message
    assert (pool.restarts, pool.malformed_replies) == (restarts + 1, malformed + 1)
    assert good.status == "ok" and good.result == VerifierResult(1.0, {"acc": 1.0})  # the replacement scores


def test_the_pickle_payload_would_run_code_if_unpickled(tmp_path):
    """The hostile frame is live: what the pool refuses unread creates the marker when unpickled."""
    import pickle

    marker = tmp_path / "unpickled"
    pickle.loads(pickle.dumps(verifiers_hostile.Evil(str(marker)))).close()
    assert marker.exists()


def test_honest_results_keep_their_floats_and_failures_keep_their_kind(pool):
    restarts, malformed = pool.restarts, pool.malformed_replies
    calls = [Call(get_verifier(name), "", "", {}) for name in ("verifiers_for_tests:returns_nan", "verifiers_for_tests:raises")]
    calls += [Call(verifiers_hostile.exact, "", "", {}), Call(verifiers_hostile.many_metrics, "", "", {})]
    nan, raises, exact, many = pool.run(calls)
    assert nan.status == "invalid" and "not a finite number" in nan.message  # as before: to_result's rule, in the worker
    assert raises.status == "error" and raises.message.startswith("ValueError")
    m = exact.result.metrics
    assert exact.status == "ok" and exact.result.score == 0.1 + 0.2 and m["third"] == 1 / 3 and m["tiny"] == 5e-324
    assert math.isnan(m["nan"]) and m["inf"] == -math.inf and m["acc"] == 1.0
    assert many.status == "error" and "result could not be sent back" in many.message and "at most 65536" in many.message
    assert (pool.restarts, pool.malformed_replies) == (restarts, malformed)  # none of these ends its worker


def _frame(**fields) -> bytes:
    reply = {"kind": "reply", "task": 3, "status": "ok", "message": "", "result": {"score": 1.0, "metrics": {}}}
    return json.dumps({**reply, **fields}).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 10_000 + b"]" * 10_000,  # deep nesting: pydantic's parser stops at depth 200
        _frame(result={"score": 1.0, "metrics": {"m": json.loads("[" * 300 + "]" * 300)}}),
        _frame(result={"score": math.nan, "metrics": {}}),  # json.dumps writes NaN; an ok score is finite
        _frame(result={"score": math.inf, "metrics": {}}),
        b'{"kind": "reply", "task": 3, "status": "ok", "message": "", "result": {"score": 1e400, "metrics": {}}}',
        _frame(result={"score": True, "metrics": {}}),
        _frame(result=None),  # ok without a result
        _frame(status="error", message="x"),  # an error with a result
        _frame(status="done"),
        _frame(task="3"),
        _frame(message="x" * 501),
        _frame(extra=1),
        _frame(result={"score": 1.0, "metrics": {"acc": "1"}}),
        json.dumps({"kind": "ready", "pid": "123"}).encode(),
        json.dumps({"kind": "exec", "code": "import os"}).encode(),
        json.dumps([3, {"status": "ok"}]).encode(),
        b"",
    ],
)
def test_frames_outside_the_declared_shape_are_refused(data):
    with pytest.raises(BadReply):
        parse_frame(data)


def test_ready_frame():
    assert parse_frame(b'{"kind": "ready", "pid": 4242}') == Ready(kind="ready", pid=4242)


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(task=st.integers(0, 2**40), score=finite, metrics=st.dictionaries(st.text(max_size=20), finite, max_size=8))
def test_results_round_trip_exactly(task, score, metrics):
    reply = parse_frame(encode_reply(task, Outcome("ok", VerifierResult(score, metrics))))
    assert reply.task == task and reply.status == "ok"
    assert reply.result.score == score and math.copysign(1, reply.result.score) == math.copysign(1, score)
    assert reply.result.metrics == metrics


def test_lone_surrogates_from_model_text_are_replaced_not_refused():
    error = parse_frame(encode_reply(1, Outcome("error", message="ValueError: cannot parse '\\ud800'")))
    assert error.status == "error" and error.message == "ValueError: cannot parse '\\ud800'"
    error = parse_frame(encode_reply(1, Outcome("error", message="ValueError: cannot parse '\ud800'")))
    assert error.status == "error" and error.message == "ValueError: cannot parse '?'"
    ok = parse_frame(encode_reply(2, Outcome("ok", VerifierResult(1.0, {"m\udcff": 0.5}))))
    assert ok.result.metrics == {"m?": 0.5}
