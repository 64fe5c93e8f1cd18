"""Preemption in the middle of a step (runtime.StopOnSignal): a SIGTERM during an update abandons it at once, before
its optimizer step, with the last completed step checkpointed; the resumed run then matches an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file

from postrl import checkpoint
from postrl.actor import Actor
from postrl.checks import load_config
from postrl.errors import Stopped
from postrl.trainer import train

STEPS = 4
OVERRIDES = (
    "reward.verifiers=[verifiers_for_tests:length_parity]", "train.deterministic=true", "logging.sinks=[jsonl]",
    f"train.total_steps={STEPS}", "train.micro_batch_size=4", "checkpoint.save_final=true",
)  # fmt: skip


def run_metrics(run) -> dict[int, dict]:
    """The logged training metrics of each step, without its wall-clock figures."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "timing/all" in r}
    return {s: {k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith("_tps")} for s, r in steps.items()}


def test_sigterm_during_an_update_abandons_it_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path, monkeypatch, capsys):
    full = load_config(None, tiny_overrides(tmp_path / "full", *OVERRIDES))
    train(full)

    seen = {"updates": 0, "micro": 0, "after_signal": 0}
    update, micro_step = Actor.update, Actor._micro_step

    def counting_update(self, *args, **kwargs):
        seen["updates"] += 1
        seen["micro"] = 0
        return update(self, *args, **kwargs)

    def micro_step_that_preempts(self, *args, **kwargs):
        if seen["updates"] == 3 and not seen["after_signal"]:
            seen["micro"] += 1
            if seen["micro"] == 2:  # step 3's update, after its first micro-batch: the scheduler's SIGTERM
                seen["after_signal"] = 1
                os.kill(os.getpid(), signal.SIGTERM)
                seen["micro_steps_run_after_signal"] = 1  # only reached if the signal did not stop the step here
        return micro_step(self, *args, **kwargs)

    monkeypatch.setattr(Actor, "update", counting_update)
    monkeypatch.setattr(Actor, "_micro_step", micro_step_that_preempts)
    cut = load_config(None, tiny_overrides(tmp_path / "cut", *OVERRIDES))
    with pytest.raises(Stopped) as info:
        train(cut)
    assert info.value.signum == signal.SIGTERM and seen["after_signal"] == 1
    said = " ".join(capsys.readouterr().out.split())
    assert "SIGTERM received: stopped after step 2 with a checkpoint" in said
    assert "step 3, which was computing its log-probs and update (before its optimizer step), was abandoned" in said
    assert "micro_steps_run_after_signal" not in seen  # abandoned at the micro-batch boundary, not finished
    ckpts = tmp_path / "cut" / "run" / "checkpoints"
    assert int((ckpts / checkpoint.TRACKER).read_text()) == 2  # the last completed step
    assert sorted(run_metrics(tmp_path / "cut" / "run")) == [1, 2]

    monkeypatch.setattr(Actor, "_micro_step", micro_step)
    train(load_config(None, tiny_overrides(tmp_path / "cut", *OVERRIDES)))  # the same command resumes from step 2
    a, b = run_metrics(tmp_path / "full" / "run"), run_metrics(tmp_path / "cut" / "run")
    assert sorted(b) == list(range(1, STEPS + 1))
    differ = {s: {k: (a[s].get(k), b[s].get(k)) for k in a[s].keys() | b[s].keys() if a[s].get(k) != b[s].get(k)} for s in a}
    assert not any(differ.values()), differ
    final = f"{checkpoint.iter_dir(ckpts, STEPS).name}/model/model.safetensors"
    wa, wb = load_file(tmp_path / "full" / "run" / "checkpoints" / final), load_file(ckpts / final)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
