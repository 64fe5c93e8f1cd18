"""`postrl serve-tinker` as a command (issue 61): it answers healthz once ready, SIGTERM saves what it holds, and
the tinker-cookbook's own sl_loop.py / rl_loop.py run unedited against it (examples/tinker_cookbook/run_loop.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_postrl

tinker = pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-cookbook-test-key-01"
NAME = "Qwen/Qwen3-8B-Base"  # a cookbook model-table name whose renderer is role_colon (any tokenizer); weights are ours


def _gsm8k_like(path: Path) -> Path:
    """Rows in GSM8K's shape (question; worked answer ending '#### N'), so the test needs no data outside the repo."""
    rows = [{"question": f"Sam has {a} apples and buys {b} more. How many apples does Sam have?",
             "answer": f"Sam has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"} for a in range(2, 10) for b in range(1, 5)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Served:
    def __init__(self, tmp: Path, *extra: str):
        self.proc = start_postrl("serve-tinker", "model.path=builtin:tiny-qwen2", "model.tiny.max_position_embeddings=2048",
                                 "--model-name", NAME, "--port", "0", "--api-key", KEY, "--state-dir", str(tmp / "state"), *extra,
                                 stderr=subprocess.STDOUT, cwd=tmp)  # fmt: skip
        self.lines: list[str] = []
        self.url = None
        deadline = time.monotonic() + 240
        while self.url is None:
            line = self.proc.stdout.readline()
            assert line or self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            self.lines.append(line)
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
                self.url = m.group(1)

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=120)
        return self.proc.returncode, "".join(self.lines) + out


def test_the_command_answers_health_once_ready_and_saves_on_sigterm(tmp_path, tiny_model_path):
    from tinker import types

    served = Served(tmp_path)
    try:
        assert httpx.get(f"{served.url}/api/v1/healthz").json() == {"status": "ok"}
        tc = tinker.ServiceClient(base_url=served.url, api_key=KEY).create_lora_training_client(base_model=NAME, rank=4).result()
        d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3})
        tc.forward_backward([d], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    finally:
        rc, out = served.stop()
    assert rc == 0, out
    path = f"tinker://{tc.model_id}/weights/on-exit"
    assert f"saved {path}" in out
    saved = tmp_path / "state" / tc.model_id.replace(":", "_") / "weights" / "on-exit"
    assert json.loads((saved / "client.json").read_text())["steps"] == 1 and (saved / "optimizer.pt").is_file()


def _loop(served: Served, tmp: Path, which: str, *args: str) -> list[dict]:
    tokenizer = Path(served.tokenizer)
    env = {**os.environ, "TINKER_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "examples/tinker_cookbook/run_loop.py"), which, "--tokenizer", str(tokenizer), "--gsm8k", str(served.data),
           "--limit", "32", "--", f"base_url={served.url}", f"model_name={NAME}", f"log_path={tmp / which}", "lora_rank=8", *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Training completed" in done.stderr + done.stdout
    return [json.loads(line) for line in (tmp / which / "metrics.jsonl").read_text().splitlines()]


def _heldout(served: Served, *samplers: str) -> list[dict]:
    """examples/tinker_cookbook/heldout.py on the served model: one JSON line per sampler."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "examples/tinker_cookbook/heldout.py"), "--base-url", served.url, "--model-name", NAME,
           "--tokenizer", str(served.tokenizer), "--gsm8k", str(served.data), "--samples", "1", "--max-tokens", "8", *samplers]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_the_cookbooks_sl_and_rl_loops_run_unedited(tmp_path):
    from postrl.builtin.tiny import build_tiny_model

    served = Served(tmp_path)
    served.tokenizer = build_tiny_model("tiny-qwen2", max_position_embeddings=2048)
    served.data = _gsm8k_like(tmp_path / "gsm8k.jsonl")
    try:
        sl = _loop(served, tmp_path, "sl", "batch_size=8", "max_length=256", "max_steps=3", "save_every=2", "learning_rate=1e-3")
        assert [m["step"] for m in sl] == [0, 1, 2] and sl[-1]["train_mean_nll"] < sl[0]["train_mean_nll"]
        rl = _loop(served, tmp_path, "rl", "loss_fn=importance_sampling", "batch_size=2", "group_size=4", "max_tokens=16", "max_steps=2", "save_every=0")
        assert [m["step"] for m in rl] == [0, 1]
        final = json.loads((tmp_path / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])["sampler_path"]
        scored = _heldout(served, "base", final)
        assert [s["sampler"] for s in scored] == ["base", final] and all(s["problems"] == 32 and 0 <= s["greedy_acc"] <= 1 for s in scored)
    finally:
        rc, out = served.stop()
    assert rc == 0, out
    assert "refused" not in out.replace("(0 requests refused", ""), out  # the loops make no request the server refuses
    assert (tmp_path / "sl" / "checkpoints.jsonl").is_file()
