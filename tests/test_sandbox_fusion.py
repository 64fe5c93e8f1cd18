"""The python tool on a SandboxFusion service (rollout.multi_turn.sandbox.backend: sandbox_fusion), against
tests/sandbox_fusion_server.py: a stand-in on 127.0.0.1 that runs the code in postrl's own local sandbox.
The hostile catalogue through this backend is in test_sandbox.py (each case in a PID namespace of its own)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import asdict

import pytest
from conftest import tiny_overrides
from sandbox_fusion_server import FakeSandboxFusion

from postrl.agents import CallStats, ToolResult, call_tool, load_tools
from postrl.agents.sandbox.sandbox import isolation, sandbox_description
from postrl.agents.sandbox import fusion as sandbox_fusion
from postrl.agents.sandbox.fusion import _result, run_remote
from postrl.sandbox_limits import SandboxLimits

pytestmark = pytest.mark.skipif(not isolation().namespaces, reason=f"the stand-in service runs the local sandbox: {sandbox_description()}")


def _remote(url: str, **extra) -> SandboxLimits:
    return SandboxLimits(backend="sandbox_fusion", url=url, **extra)


def test_the_tool_gets_the_local_sandboxs_results_and_metrics():
    with FakeSandboxFusion() as service:
        tools = load_tools(["builtin:python"], sandbox_limits=asdict(_remote(service.url, memory_mb=300)))
        stats = CallStats()
        assert call_tool(tools, "python", {"code": "print(6 * 7)"}, 4, stats=stats).text == "42\n"
        res = call_tool(tools, "python", {"code": "print('before')\n1 / 0"}, 4, stats=stats)
        assert res.status == "error" and res.text.startswith("before\n") and res.text.endswith("ZeroDivisionError: division by zero")
        assert call_tool(tools, "python", {"code": "while True:\n    pass"}, 1, stats=stats) == ToolResult("[timed out after 1 s]", "timeout")
        assert stats.as_metrics() == {"sandbox/success": 1, "sandbox/error": 1, "sandbox/timeout": 1}
        assert [(b["language"], b["run_timeout"], b["memory_limit_MB"]) for b in service.bodies] == [("python", 4, 300), ("python", 4, 300), ("python", 1, 300)]


@pytest.mark.parametrize("status", [502, 503, 429])
def test_an_answer_that_reached_the_service_is_never_sent_again(status):
    """A 502 / 503 from a proxy may come after the service ran the code: one request, whatever the retries."""
    with FakeSandboxFusion(fail_first=1, fail_status=status) as service:
        res = run_remote("print('ran')", _remote(service.url, retries=3), timeout_s=10)
        assert res.error == "setup" and f"HTTP {status}" in res.stderr and service.requests == 1, res
        assert run_remote("print('ran')", _remote(service.url, retries=3), timeout_s=10).stdout == "ran\n" and service.requests == 2


def test_only_a_connection_that_could_not_be_made_is_retried():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_remote("print(1)", _remote(f"http://127.0.0.1:{port}", retries=1, connect_timeout_s=1), timeout_s=10)
    assert res.error == "setup" and f"at http://127.0.0.1:{port} is unreachable after 1 retries" in res.stderr
    with FakeSandboxFusion() as service:  # a connection the service drops after reading the request: not sent again
        service.run = lambda body: (_ for _ in ()).throw(ConnectionAbortedError("dropped"))
        res = run_remote("print(1)", _remote(service.url, retries=3), timeout_s=10)
        assert res.error == "setup" and service.requests == 1 and "broke before its answer (not sent again" in res.stderr, res


def test_retry_after_is_capped_and_holds_back_the_next_call():
    with FakeSandboxFusion(fail_first=1, fail_headers={"Retry-After": "99999"}) as service:
        url = service.url + "/"  # the same service, a different key of the module's hold-back table than other tests
        res = run_remote("print(1)", _remote(url, retry_after_max_s=0.2), timeout_s=10)
        assert res.error == "setup" and "HTTP 503" in res.stderr and service.requests == 1
        before = time.monotonic()
        res = run_remote("print(2)", _remote(url, retry_after_max_s=0.2), timeout_s=10)
        assert (res.error, res.stdout, service.requests) == (None, "2\n", 2)
        assert 0.15 <= time.monotonic() - before < 30  # held back for the cap, not for 99999 s
    assert sandbox_fusion._retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and sandbox_fusion._retry_after_s("x") is None


@pytest.mark.parametrize("content_length", [True, False])
def test_a_reply_is_read_up_to_max_reply_bytes(content_length):
    with FakeSandboxFusion(reply_bytes=512 << 20, content_length=content_length) as service:
        res = run_remote("print(1)", _remote(service.url, max_reply_bytes=1 << 20), timeout_s=10)
        assert res.error == "output_limit" and res.truncated and "longer than max_reply_bytes (1048576)" in res.stderr, res
    assert service.sent < 64 << 20  # the client hung up: the server got out far less than its 512 MiB


def test_plain_http_to_another_host_is_warned_about(caplog):
    from postrl.agents.tools.tools import start_python_tool

    for url in ("http://127.0.0.1:8080", "http://localhost:1", "http://[::1]:8080", "https://sandbox.example:443"):
        assert sandbox_fusion.plain_http_warning(url) is None, url
    warning = sandbox_fusion.plain_http_warning("http://10.1.2.3:8080")
    assert warning.startswith("WARNING: rollout.multi_turn.sandbox.url is plain http:// to 10.1.2.3") and "https://" in warning
    said = []
    start_python_tool({"backend": "sandbox_fusion", "url": "http://sandbox-host:8080"}, said.append)
    assert "plain http:// to sandbox-host" in said[0] and "plain http://" in caplog.text


def test_at_most_concurrency_requests_are_in_flight():
    with FakeSandboxFusion() as service:
        results = []
        threads = [threading.Thread(target=lambda: results.append(run_remote("import time\ntime.sleep(0.3)\nprint('ok')", _remote(service.url, concurrency=2), timeout_s=10)))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.stdout for r in results] == ["ok\n"] * 6
        assert service.requests == 6 and service.max_inflight == 2


def test_sandbox_fusions_answers_map_to_the_local_error_kinds():
    finished = {"status": "Finished", "execution_time": 0.1, "stdout": "", "stderr": ""}
    assert _result({**finished, "return_code": 0}, 100, 5, 0).error is None
    assert _result({**finished, "return_code": 1, "stderr": "MemoryError\n"}, 100, 5, 0).error == "memory"
    killed = _result({**finished, "return_code": -9}, 100, 5, 0)
    assert (killed.error, killed.exit_status) == ("signal", 137)
    late = _result({"status": "TimeLimitExceeded", "execution_time": 5.0, "return_code": None, "stdout": "x", "stderr": ""}, 100, 5, 0)
    assert (late.error, late.timed_out, late.stdout) == ("timeout", True, "x")
    cut = _result({**finished, "return_code": 0, "stdout": "é" * 100}, 101, 5, 0)
    assert (cut.error, cut.truncated, cut.stdout) == ("output_limit", True, "é" * 50)


class FirstTurnCallsPython:
    """The tiny random model never writes a tool call: its first turn of every trajectory is this call,
    the turns after it are the model's own (the policy still trains on both)."""

    def __init__(self, engine, tokenizer, code: str):
        self.engine, self.calls = engine, 0
        text = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, multi_modal=None):
        from postrl.rollout.base import Completion

        self.calls += 1
        if self.calls % 2 == 0:  # max_turns 2: turn 2 is the model's
            return self.engine.generate(prompts, params, multi_modal=multi_modal)
        n = 1 if params.greedy else params.n
        return [Completion(i, list(self.ids), True, [-1.0] * len(self.ids)) for i in range(len(prompts)) for _ in range(n)]


def test_a_tool_run_on_sandbox_fusion_trains_two_steps(tmp_path):
    from postrl.checks import load_config
    from postrl.trainer import Trainer

    with FakeSandboxFusion() as service:
        cfg = load_config(None, tiny_overrides(
            tmp_path, "model.path=builtin:tiny-qwen2-tools", "data.train_files=[builtin:tool_arithmetic:train]",
            "data.val_files=[builtin:tool_arithmetic:val]", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[builtin:python]",
            "rollout.multi_turn.max_turns=2", "rollout.max_tokens=48", "train.total_steps=2", "data.tool_arithmetic.train_size=64",
            "data.tool_arithmetic.val_size=8", "reward.verifiers=[verifiers_for_tests:length_parity]",  # mixed groups: it learns
            "rollout.multi_turn.sandbox.backend=sandbox_fusion", f"rollout.multi_turn.sandbox.url={service.url}",
        ))  # fmt: skip
        tr = Trainer(cfg)
        tr.engine.engine = FirstTurnCallsPython(tr.engine.engine, tr.tokenizer, "print(6 * 7)")
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "agent/tool_ok" in r]
    assert len(rows) == 2 and all(r["agent/tool_ok"] == 16 and r["agent/tool_error"] == 0 for r in rows)  # 4 prompts x 4
    assert service.requests == 32 and all(b["run_timeout"] == cfg.rollout.multi_turn.tool_timeout_s for b in service.bodies)
    assert any(not p.detach().equal(before[n]) for n, p in tr.model.named_parameters())
