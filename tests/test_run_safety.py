"""Faults around a run's files: preemption (SIGTERM), a second run on one directory, directories that
cannot be written, a full disk, damaged checkpoint files, exporting a damaged checkpoint.

Each fault either loses nothing or stops with one clear paragraph (what, why, how to fix) and no
traceback. The bad-input cases live in tests/test_catalogue.py; both are listed in docs/reliability.md.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_postrl, start_postrl, tiny_cfg, tiny_train_args, tiny_trainer
from safetensors.torch import load_file

from postrl import checkpoint
from postrl.errors import UserError

DETERMINISTIC = ("reward.verifiers=[verifiers_for_tests:length_parity]", "train.deterministic=true", "logging.sinks=[jsonl]")


def _train(tmp_path: Path, *extra: str, **popen) -> subprocess.Popen:
    return start_postrl(*tiny_train_args(tmp_path, *DETERMINISTIC, *extra), **popen)


def _steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [r["step"] for r in rows if "timing/all" in r]


@pytest.mark.slow
def test_sigterm_saves_the_step_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path):
    """SIGTERM after step 2 of 5: a checkpoint at the step reached, exit 143 with no traceback; the same
    command then finishes the run, and its final weights equal an uninterrupted run's bit for bit."""
    full = _train(tmp_path / "full", "train.total_steps=5", "checkpoint.save_final=true")
    out, err = full.communicate(timeout=600)
    assert full.returncode == 0, err[-2000:]

    cut = tmp_path / "cut"
    proc = _train(cut, "train.total_steps=5", "checkpoint.save_final=true", start_new_session=True)
    deadline = time.monotonic() + 600
    while max(_steps_logged(cut / "run"), default=0) < 2:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: the trainer and its verifier workers
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in out + err
    assert "SIGTERM received: stopped after step" in out
    ckpts = cut / "run" / "checkpoints"
    stopped_at = int((ckpts / checkpoint.TRACKER).read_text())
    assert 2 <= stopped_at < 5 and max(_steps_logged(cut / "run")) == stopped_at

    again = _train(cut, "train.total_steps=5", "checkpoint.save_final=true")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    assert f"resumed from {ckpts / checkpoint.iter_dir(ckpts, stopped_at).name} at step {stopped_at}" in out.replace("\n", "")
    a = load_file(tmp_path / "full" / "run" / "checkpoints" / "iter_0000005" / "model" / "model.safetensors")
    b = load_file(ckpts / "iter_0000005" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_run_on_the_same_directory_is_refused_and_told_who_holds_it(tmp_path):
    (tmp_path / "run").mkdir()
    script = (
        "import sys, time; from postrl.checkpoint import RunLock; RunLock(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(60)"
    )
    other = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        proc = _train(tmp_path)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2 and "Traceback" not in out + err
        text = " ".join(out.split())
        assert f"is in use by pid {other.pid}" in text and "give this run its own logging.dir" in text
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("which", ["logging.dir", "checkpoint.dir"])
def test_a_run_directory_that_is_a_file_is_refused_before_the_model_loads(tmp_path, which):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = tiny_cfg(tmp_path, f"{which}={blocker / 'sub'}")
    with pytest.raises(UserError) as info:
        checkpoint.check_run_dirs(cfg)
    assert f"{which} '{blocker / 'sub'}' is a file, not a directory" in info.value.problems[0]
    proc = _train(tmp_path, f"{which}={blocker}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in out + err
    assert "Loading weights" not in err  # refused before the model loaded


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    tr = tiny_trainer(tmp_path, *DETERMINISTIC, "train.total_steps=1")
    cfg = tr.cfg
    tr.step = 1
    first = checkpoint.save(cfg, tr.state_dict())
    real_save = torch.save

    def full_disk(obj, path, *a, **k):
        if "rng_rank" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    tr.step = 2
    with pytest.raises(UserError) as info:
        checkpoint.save(cfg, tr.state_dict())
    monkeypatch.undo()
    msg = info.value.problems[0]
    assert "is full" in msg and "the previous checkpoint (iter_0000001) is intact" in msg and "free space" in msg
    root = Path(cfg.checkpoint.dir)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", checkpoint.TRACKER]  # no partial directory
    assert checkpoint.find_resume_dir(cfg) == first
    tr.close()


def _two_checkpoints(tmp_path: Path) -> Path:
    tr = tiny_trainer(tmp_path, *DETERMINISTIC, "train.total_steps=2", "checkpoint.save_freq=1", "checkpoint.keep_last=0")
    tr.fit()
    return Path(tr.cfg.checkpoint.dir)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    return _two_checkpoints(tmp_path_factory.mktemp("two"))


@pytest.mark.parametrize("damaged", ["model/model.safetensors", "optimizer/rank0.pt"])
def test_a_damaged_checkpoint_file_is_named_with_the_way_back(two_checkpoints, tmp_path, damaged):
    import shutil

    root = tmp_path / "ckpts"
    shutil.copytree(two_checkpoints, root)
    f = root / "iter_0000002" / damaged
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])  # truncated, as by a full disk or a bad copy
    proc = run_postrl(*tiny_train_args(tmp_path, *DETERMINISTIC, f"checkpoint.dir={root}"), timeout=300)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert f"{f} is damaged and cannot be read" in text
    assert f"the earlier checkpoint iter_0000001 is intact: write 1 into {root / checkpoint.TRACKER}" in text


def test_export_of_a_damaged_checkpoint_fails_and_writes_nothing(two_checkpoints, tmp_path):
    import shutil

    root = tmp_path / "ckpts"
    shutil.copytree(two_checkpoints, root)
    f = root / "iter_0000002" / "model" / "model.safetensors"
    f.write_bytes(b"garbage" * 10)
    out = tmp_path / "exported"
    proc = run_postrl("export", str(root), str(out), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "is damaged and cannot be read" in " ".join(proc.stdout.split()) and not out.exists()
    assert checkpoint.export(root / "iter_0000001", out) == out  # the intact one exports
