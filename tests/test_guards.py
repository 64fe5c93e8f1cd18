"""Correctness guards (src/postrl/guards.py): each fires when provoked and stays silent on a healthy run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import quiet_console, tiny_trainer

import postrl.lora
from postrl import checkpoint, guards
from postrl.checks import load_config
from postrl.trainer import Trainer

PARITY = "reward.verifiers=[verifiers_for_tests:length_parity]"


def _output(tr: Trainer) -> str:
    return tr.console.file.getvalue()


def _fired(tr: Trainer) -> list[str]:
    """The guards that spoke ("guard <name>: ...")."""
    return re.findall(r"guard ([a-z_]+):", _output(tr))


def test_a_healthy_run_trips_no_guard(tmp_path):
    """Off-policy (two optimizer steps per batch, so the first-ratio check is live), KL, dynamic sampling."""
    tr = tiny_trainer(tmp_path, PARITY, "algorithm.name=dapo", "algorithm.overlong_buffer.len=4", "train.mini_batch_size=2",
                  "algorithm.kl.coef=0.01", "train.total_steps=3")  # fmt: skip
    tr.fit()
    assert _fired(tr) == [], _output(tr)


def test_first_ratio_fires_when_the_two_log_prob_passes_disagree(tmp_path):
    """Attention dropout left on makes the old-log-prob pass and the update pass differ before any step."""
    tr = tiny_trainer(tmp_path, PARITY, "train.mini_batch_size=2", "train.total_steps=1")
    for module in tr.model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    tr.fit()
    assert "guard first_ratio: before the first optimizer step the policy ratio should be exactly 1" in _output(tr)


def test_no_signal_fires_when_every_group_has_the_same_reward(tmp_path):
    tr = tiny_trainer(tmp_path, "reward.verifiers=[verifiers_for_tests:never]", "train.total_steps=3", "guards.no_signal_steps=3")
    tr.fit()
    out = _output(tr)
    assert "guard no_signal: for 3 steps every group's rewards were all equal" in out
    assert out.count("guard no_signal") == 1  # said once


@pytest.mark.parametrize(
    "metrics, expected",
    [
        ({"rollout/logprob_diff_mean": 0.5}, "guard drift: the engine's sampling log-probs differ from the trainer's by 0.500"),
        ({"reward/timeouts": 3, "reward/calls": 16}, "guard slow_reward: 3 of 16 reward calls this step hit reward.timeout_s"),
    ],
)
def test_step_guards_fire_on_their_numbers(tmp_path, metrics, expected):
    tr = tiny_trainer(tmp_path, PARITY, "train.total_steps=1")
    healthy = tr.train_step()
    tr.close()
    tr.guards.after_step(healthy, 1)
    assert _fired(tr) == []
    tr.guards.after_step({**healthy, **metrics}, 1)
    assert expected in _output(tr)


def test_entropy_collapse_fires_after_its_streak_only(tmp_path):
    tr = tiny_trainer(tmp_path, PARITY, "train.total_steps=1", "guards.entropy_steps=3")
    healthy = tr.train_step()
    tr.close()
    collapsed = {**healthy, "actor/entropy": 0.001}
    tr.guards.after_step(collapsed, 1)
    tr.guards.after_step(collapsed, 1)
    assert _fired(tr) == []
    tr.guards.after_step(healthy, 1)  # the streak restarts
    for _ in range(3):
        tr.guards.after_step(collapsed, 1)
    assert "guard entropy: actor/entropy has stayed below 0.01 for 3 steps" in _output(tr)


def test_the_guards_functions_are_silent_within_their_limits():
    assert guards.first_ratio(0.0, 1e-3) is None and guards.first_ratio(2e-3, 1e-3)
    assert guards.sync(1e-5, 1e-3, "vllm") is None and "did not receive the updated weights" in guards.sync(0.2, 1e-3, "vllm")
    assert guards.drift(None, 0.1) is None and guards.drift(0.05, 0.1) is None
    assert guards.slow_reward(0, 0, 0.1, 5.0) is None and guards.slow_reward(1, 16, 0.1, 5.0) is None
    assert guards.no_signal(2, 3) is None and guards.entropy(0.0, 0.01, 2, 3) is None


def test_log_prob_tolerances_follow_the_compute_dtype():
    """first_ratio and sync compare two computations of the same log-probs: every token within 1e-3 in
    float32, the mean within 5e-2 in bf16 / fp16 (another kernel rounds differently, a few unlikely
    tokens by much more); a configured tolerance wins in both."""

    def tol(dtype, configured=None):
        return guards.Guards(load_config(None, ["model.path=builtin:tiny-qwen2", f"model.dtype={dtype}"])).tolerance(configured)

    assert tol("float32") == 1e-3 and tol("bfloat16") == 5e-2 and tol("float16") == 5e-2
    assert tol("bfloat16", 1e-4) == 1e-4
    assert guards.first_ratio(2e-2, tol("bfloat16"), "mean") is None and guards.first_ratio(2e-2, tol("float32"))
    # Which gap each dtype judges: the largest token in float32, the mean in bf16.
    step = {"actor/first_ratio_gap": 0.3, "actor/first_ratio_gap_mean": 0.01}
    bf16 = guards.Guards(load_config(None, ["model.path=builtin:tiny-qwen2", "model.dtype=bfloat16"]))
    fp32 = guards.Guards(load_config(None, ["model.path=builtin:tiny-qwen2"]))
    assert bf16._first_ratio_gap(step) == (0.01, "mean") and fp32._first_ratio_gap(step) == (0.3, "largest")


def test_resume_warns_on_a_changed_world_size_and_a_run_with_nothing_left(tmp_path):
    tr = tiny_trainer(tmp_path, PARITY, "train.total_steps=1", "checkpoint.save_final=true")
    tr.fit()
    cfg = tr.cfg
    meta = checkpoint.describe(Path(cfg.checkpoint.dir) / "iter_0000001")
    problems = checkpoint.setting_changes(cfg, {**meta, "world_size": 2}, 1, meta["train_prompts"])
    assert any("written by 2 rank(s), this run has 1" in p for p in problems)
    again = tiny_trainer(tmp_path, PARITY, "train.total_steps=1", "checkpoint.save_final=true")
    assert "nothing to train: the checkpoint is at step 1 and train.total_steps is 1" in _output(again)
    again.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype, lora", [("float32", False), ("bfloat16", False), ("float32", True)], ids=["float32", "bfloat16", "lora"])
def test_the_sync_guard_stops_a_run_whose_engine_missed_a_weight_sync(tmp_path, dtype, lora):
    """vLLM on CPU: a healthy step passes the probe; a skipped sync after an update at a high LR is caught.
    In float32 on the largest gap over the probe's tokens; in bf16 (vLLM holds bf16 weights, the trainer
    computes under autocast) on the mean gap. With LoRA adapters the engine receives the merged weights
    (W + s B A), which must give the trainer's log-probs to 1e-3 in fp32. Rollout correction (TIS) runs on
    the same steps and logs its weights. The engine runs eager here (rollout.enforce_eager), so that path
    keeps a test; tests/test_vllm_engine.py runs the compiled default."""
    import postrl.rollout.vllm_platform as vllm_platform
    from postrl.errors import UserError

    try:
        vllm_platform.import_vllm()
    except vllm_platform.VLLMUnavailable as exc:  # pragma: no cover - machines without a working vLLM
        pytest.skip(f"vLLM is unavailable here: {exc}")
    tr = tiny_trainer(tmp_path, PARITY, "rollout.engine=vllm", "rollout.kv_cache_space_gb=0.25", "train.lr=1e-2",
                  "train.total_steps=1", "algorithm.rollout_correction.enable=true", f"model.dtype={dtype}",
                  "rollout.enforce_eager=true", *(["model.lora_rank=4"] if lora else []))  # fmt: skip
    try:
        assert tr.engine.name == "vllm" and tr.engine.dtype == getattr(torch, dtype)
        assert postrl.lora.is_lora(tr.model) == lora
        step = tr.train_step()  # a healthy step: synced, the probe agrees
        assert _fired(tr) == []
        assert 0.5 < step["rollout_corr/weight_mean"] <= 2.0 and 0 <= step["rollout_corr/capped_frac"] <= 1
        tr.engine.sync_weights = lambda model: None  # the engine silently keeps its old weights
        statistic = "largest" if dtype == "float32" else "mean"
        with pytest.raises(UserError, match=f"guard sync: after the weight sync the vllm engine's log-probs .*\\({statistic} gap"):
            tr.train_step()
    finally:
        tr.close()


@pytest.mark.parametrize("recipe", ["tiny_gspo.yaml", "tiny_rloo.yaml"])
def test_the_gspo_and_rloo_recipes_train_on_the_tiny_model(tmp_path, recipe):
    """The shipped recipes, shortened, on the random-init tiny model: they run, update and log their loss."""
    from postrl.metrics import read_jsonl

    configs = Path(__file__).resolve().parents[1] / "configs"
    cfg = load_config(configs / recipe, [
        "model.path=builtin:tiny-qwen2", "rollout.engine=hf", "rollout.max_tokens=12", "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=4", "train.gen_batch_size=4", "train.mini_batch_size=2", "train.total_steps=2",
        "data.builtin.train_size=200", "data.builtin.val_size=16", "eval.before_train=false", "eval.after_train=false",
        "eval.freq=0", "logging.progress=false", f"logging.dir={tmp_path / 'run'}", "checkpoint.save_final=false",
        "reward.verifiers=[verifiers_for_tests:length_parity]",
    ])  # fmt: skip
    Trainer(cfg, quiet_console()).fit()
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    assert len(steps) == 2 and all(r["actor/grad_norm"] > 0 for r in steps)
