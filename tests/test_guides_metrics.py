"""logging.metric_names: the guides' dashboards find their names in metrics.jsonl (docs/metrics.md)."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_overrides
from postrl.cli import main
from postrl.metrics import lookup, rename_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The names the guides' dashboards read (issue 26), every one of which a run must write.
MINDSPEED = [
    "grad_norm", "dapo/lr", "timing/non_overlap_reference_model", "timing/non_overlap_adv", "timing/ref_onload",
    "timing/ref_offload", "timing/reshard_to_infer", "timing/reshard_to_train", "timing/rule_reward",
    "timing/non_overlap_rule_reward", "timing/all", "timing/rollout", "timing/old_log_p", "timing/update",
    "dapo/score/mean", "dapo/rewards/mean", "actor/pg_loss", "response_length/mean", "e2e_tps", "update_tps", "vllm_tps",
    "dapo/math_17k_acc_rewards/mean",
]  # fmt: skip
VERL = [
    "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv", "timing_s/update_actor",
    "timing_s/step", "timing_s/reshard", "timing_s/generate_sequences", "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean",
    "critic/rewards/max", "critic/rewards/min", "perf/total_num_tokens", "perf/time_per_step", "perf/throughput",
    "actor/pg_loss", "actor/grad_norm", "actor/lr", "response_length/mean", "response_length/clip_ratio", "prompt_length/mean",
]  # fmt: skip


def test_rename_formulas():
    m = {"timing/all": 2.0, "e2e_tps": 50.0, "total_tokens": 100.0, "dapo/score/mean": 0.5, "actor/lr": 1e-6, "x": 1.0}
    verl = rename_metrics(m, "verl", "dapo")
    assert verl == {"timing_s/step": 2.0, "perf/time_per_step": 2.0, "perf/throughput": 50.0, "e2e_tps": 50.0,
                    "perf/total_num_tokens": 100.0, "critic/score/mean": 0.5, "actor/lr": 1e-6, "x": 1.0}  # fmt: skip
    ms = rename_metrics(m, "mindspeed", "dapo")
    assert (ms["dapo/lr"], ms["actor/lr"], ms["timing/all"]) == (1e-6, 1e-6, 2.0)
    assert rename_metrics(m, "postrl", "dapo") is m
    assert lookup(verl, "dapo/score/mean", "dapo") == 0.5  # report / plots read any mode's file


def test_per_verifier_alias_and_verl_rollout_timings():
    m = {"grpo/acc_for_dapo/mean": 0.25, "grpo/acc/mean": 0.5, "grpo/rewards/mean": -0.5, "timing/rollout": 3.0,
         "timing/resharding_to_infer": 0.5}  # fmt: skip
    ms = rename_metrics(m, "mindspeed", "grpo")
    assert ms["grpo/acc_for_dapo_rewards/mean"] == 0.25 and ms["grpo/acc_for_dapo/mean"] == 0.25
    assert "grpo/acc_rewards/mean" not in ms and "grpo/rewards_rewards/mean" not in ms  # not verifiers
    verl = rename_metrics(m, "verl", "grpo")
    assert (verl["timing_s/gen"], verl["timing_s/generate_sequences"], verl["timing_s/reshard"]) == (3.0, 3.0, 0.5)


@pytest.mark.parametrize("mode, names", [("verl", VERL), ("mindspeed", MINDSPEED)])
def test_two_step_run_logs_every_name(mode, names, tmp_path):
    args = tiny_overrides(
        tmp_path, "train.total_steps=2", f"logging.metric_names={mode}", "algorithm.kl.coef=0.01",
        "algorithm.filter_groups.enable=false", "train.ref_offload=true",
    )  # fmt: skip
    assert main(["train", "configs/tiny_dapo.yaml", *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert [n for n in names if n not in r] == []
        if mode == "verl":
            assert "timing/all" not in r and "dapo/score/mean" not in r  # replaced, not doubled
            assert r["perf/time_per_step"] == r["timing_s/step"]
            assert r["perf/throughput"] == pytest.approx(r["perf/total_num_tokens"] / r["timing_s/step"])  # one device
        else:
            assert r["timing/non_overlap_reference_model"] == r["timing/reference_model"] > 0
            assert r["grad_norm"] == r["actor/grad_norm"] and r["dapo/lr"] == r["actor/lr"]
    assert (tmp_path / "run" / "training.png").exists()  # the plot reads the renamed file
