"""Agent programs that fail on every sample, or hang, in a real `postrl train` (agents/programs/programs.py `check_outcomes`,
runtime.py `StopOnSignal.abandonable`): the run stops after the batch with the first error and the fix, or, on
SIGTERM, abandons the stuck step within a bound and keeps the trained steps' checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import start_postrl, tiny_train_args
from safetensors.torch import load_file

from postrl import checkpoint

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import os, time

CALLS = [0]


def run(client, row):
    CALLS[0] += 1
    mode = os.environ["AGENT_MODE"]
    if mode == "raise":
        raise ValueError("the user's bug in the program")
    if mode == "hang" and CALLS[0] > int(os.environ["HANG_AFTER"]):  # from the second step on
        open(os.environ["HANG_MARK"], "w").close()
        time.sleep(3600)
    client.chat.completions.create(model=client.model, messages=row["prompt"], max_tokens=8)
    return None
"""


def _train(tmp_path: Path, mode: str, workers: int, *extra: str) -> subprocess.Popen:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    args = tiny_train_args(tmp_path, f"rollout.agent={program}:run", f"rollout.agent_workers={workers}", "rollout.agent_timeout_s=3600",
                           "algorithm.filter_groups.enable=false", "reward.verifiers=[verifiers_for_tests:length_parity]",
                           "rollout.agent_env_passthrough=[AGENT_MODE,HANG_AFTER,HANG_MARK]", *extra)  # fmt: skip
    env = {"AGENT_MODE": mode, "HANG_AFTER": "16", "HANG_MARK": str(tmp_path / "hung"), "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    return start_postrl(*args, env=env, start_new_session=True)


def _steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if "timing/all" in r]


@pytest.mark.slow
def test_a_program_that_fails_on_every_sample_stops_the_run_after_that_batch_with_the_first_error(tmp_path):
    proc = _train(tmp_path, "raise", 0, "train.total_steps=3")
    out, err = proc.communicate(timeout=600)
    said = " ".join((out + err).split())
    assert proc.returncode == 2, said[-3000:]
    assert "Traceback" not in said and "fails on (nearly) every sample" in said
    assert "failed on 16 of the 16 samples of this batch" in said and "ValueError: the user's bug in the program" in said
    assert "Fix the program" in said and _steps_logged(tmp_path / "run") == []  # stopped after the first batch


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_sigterm_abandons_a_step_stuck_in_rollout_and_keeps_the_trained_steps_checkpoint(tmp_path, workers):
    """Step 1 trains and is checkpointed (save_freq 1); step 2's programs hang (a thread of the trainer, or a
    worker process). SIGTERM ends the run within 60 s: exit 143, no traceback, the checkpoint of step 1 whole."""
    proc = _train(tmp_path, "hang", workers, "train.total_steps=3", "checkpoint.save_freq=1")
    deadline = time.monotonic() + 600
    while not (tmp_path / "hung").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "step 2 never started"
        time.sleep(0.2)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 143, (out + err)[-3000:]
    assert took < 60, took
    said = " ".join(out.split())
    assert "Traceback" not in out + err and "SIGTERM received: stopped after step 1 with a checkpoint" in said and "step 2, which was collecting its batch, was abandoned" in said
    ckpts = tmp_path / "run" / "checkpoints"
    assert int((ckpts / checkpoint.TRACKER).read_text()) == 1 and not (ckpts / "iter_0000002").exists()
    assert load_file(ckpts / "iter_0000001" / "model" / "model.safetensors")  # whole: it loads
    assert _steps_logged(tmp_path / "run") == [1]
