"""Config: every shipped YAML validates; DAPO defaults; overrides; every problem reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_postrl

from postrl.checks import load_config
from postrl.config import build_config
from postrl.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml"))



def config_problems(tree: dict) -> list[str]:
    """Every problem `build_config` reports for `tree` (it must report some)."""
    with pytest.raises(UserError) as info:
        build_config(tree)
    return info.value.problems

def test_there_are_configs():
    names = {p.name for p in TRAIN_CONFIGS}
    assert {"tiny_sft.yaml", "tiny_grpo.yaml", "tiny_dapo.yaml"} <= names


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    # Paths are not checked: the guides' recipes name hub models and cluster data paths.
    cfg = load_config(path, check_paths=False)
    assert cfg.rollout.n_samples_per_prompt >= 2
    assert cfg.train.gen_batch_size >= cfg.train.global_batch_size


def test_dapo_switches_defaults_on_and_grpo_keeps_them_off():
    dapo = build_config({"model": {"path": "m"}, "algorithm": {"name": "dapo"}})
    a = dapo.algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert a.overlong_buffer.enable and a.filter_groups.enable and a.kl.coef == 0
    grpo = build_config({"model": {"path": "m"}}).algorithm
    assert (grpo.clip_ratio_high, grpo.loss_agg_mode) == (0.2, "seq-mean-token-mean")
    assert not grpo.overlong_buffer.enable and not grpo.filter_groups.enable


def test_each_dapo_piece_works_alone_under_grpo():
    cfg = build_config(
        {"model": {"path": "m"}, "algorithm": {"name": "grpo", "filter_groups": {"enable": True}, "clip_ratio_high": 0.28}}
    )
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.clip_ratio_high == 0.28
    assert not cfg.algorithm.overlong_buffer.enable and cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"


def test_dotted_overrides_are_typed(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "tiny_dapo.yaml",
        ["algorithm.clip_ratio_high=0.3", "train.total_steps=5", "rollout.engine=hf", "data.val_files=[a.parquet]"],
        check_paths=False,
    )
    assert cfg.algorithm.clip_ratio_high == 0.3 and cfg.train.total_steps == 5
    assert cfg.rollout.engine == "hf" and cfg.data.val_files == ["a.parquet"]


def test_all_problems_are_reported_at_once():
    tree = {
        "model": {},  # missing path
        "rollout": {"n_samples_per_prompt": 1},
        "algorithm": {"clip_ratio_c": 1.0, "clip_ratio_hgih": 0.3},
        "train": {"global_batch_size": 16, "gen_batch_size": 8, "lr": "fast"},
    }
    problems = config_problems(tree)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "model.path: required" in text
    assert "rollout.n_samples_per_prompt" in text and "greater than or equal to 2" in text
    assert "algorithm.clip_ratio_c" in text and "greater than 1" in text
    assert "unknown key 'clip_ratio_hgih'" in text and "Did you mean 'clip_ratio_high'" in text
    assert "train.lr" in text
    assert "train.gen_batch_size (8) is smaller than train.global_batch_size (16)" in text


def test_missing_model_directory_is_reported(tmp_path):
    with pytest.raises(UserError) as info:
        load_config(None, [f"model.path={tmp_path}/nope/model"])
    assert "does not exist" in info.value.problems[0] and "postrl sft" in info.value.problems[0]


def test_check_config_cli_exits_nonzero_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: {path: ./no/such/model}\n"
        "rollout: {n_samples_per_prompt: 1}\n"
        "algorithm: {clip_ratio_c: 0.5, bogus: 1}\n"
        "train: {global_batch_size: 8, gen_batch_size: 4, micro_batch_size: many}\n"
    )
    proc = run_postrl("check-config", str(bad), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    for needle in ("n_samples_per_prompt", "clip_ratio_c", "unknown key 'bogus'", "micro_batch_size", "gen_batch_size (4)"):
        assert needle in out, (needle, out)
    # The path check runs only when the schema is valid; a valid schema with a missing model is reported too.
    ok_schema = tmp_path / "missing_model.yaml"
    ok_schema.write_text("model: {path: ./no/such/model}\n")
    proc = run_postrl("check-config", str(ok_schema), cwd=tmp_path)
    assert proc.returncode == 2 and "model.path" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_check_config_prints_resolved_config():
    proc = run_postrl("check-config", str(ROOT / "configs" / "tiny_dapo.yaml"), "--no-path-check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "clip_ratio_high: 0.28" in proc.stdout and "loss_agg_mode: token-mean" in proc.stdout


def test_algorithm_names_come_from_the_registries():
    from postrl import algorithms

    cfg = build_config({"model": {"path": "m"}})
    a = cfg.algorithm
    assert (a.adv_estimator, a.policy_loss, a.clip_ratio_low) == ("grpo", "vanilla", 0.2)
    assert (a.rollout_correction.enable, a.rollout_correction.level, a.rollout_correction.cap) == (False, "token", 2.0)
    for name in algorithms.ADV_ESTIMATORS:
        assert build_config({"model": {"path": "m"}, "algorithm": {"adv_estimator": name}}).algorithm.adv_estimator == name
    for name in algorithms.POLICY_LOSSES:
        assert build_config({"model": {"path": "m"}, "algorithm": {"policy_loss": name}}).algorithm.policy_loss == name
    for mode in algorithms.LOSS_AGGREGATIONS:
        assert build_config({"model": {"path": "m"}, "algorithm": {"loss_agg_mode": mode}}).algorithm.loss_agg_mode == mode


def test_unknown_algorithm_names_are_all_reported_with_the_valid_ones():
    tree = {
        "model": {"path": "m"},
        "algorithm": {
            "adv_estimator": "rlooo",
            "policy_loss": "ppo",
            "loss_agg_mode": "token-sum",
            "kl": {"estimator": "k4"},
            "rollout_correction": {"level": "batch", "cap": 1.0},
        },
    }
    problems = config_problems(tree)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "algorithm.adv_estimator: unknown advantage estimator 'rlooo'. Did you mean 'rloo'?" in text
    assert "reinforce_plus_plus_baseline" in text and "drgrpo" in text
    assert "algorithm.policy_loss: unknown policy loss 'ppo'" in text and "vanilla, gspo, cispo" in text
    assert "algorithm.loss_agg_mode: unknown loss_agg_mode 'token-sum'" in text and "seq-mean-token-sum-norm" in text
    assert "algorithm.kl.estimator: unknown KL estimator 'k4'" in text and "low_var_kl" in text
    assert "algorithm.rollout_correction.level: unknown rollout correction level 'batch'" in text
    assert "token, sequence" in text
    assert "algorithm.rollout_correction.cap" in text and "greater than 1" in text


def test_gspo_derives_the_paper_clip_range_and_sequence_mean():
    a = build_config({"model": {"path": "m"}, "algorithm": {"policy_loss": "gspo"}}).algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    # over dapo's clip-higher and token-mean too; set values are kept
    a = build_config({"model": {"path": "m"}, "algorithm": {"name": "dapo", "policy_loss": "gspo"}}).algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert a.filter_groups.enable and a.overlong_buffer.enable  # the rest of dapo stays
    a = build_config(
        {"model": {"path": "m"}, "algorithm": {"policy_loss": "gspo", "clip_ratio_high": 1e-3, "loss_agg_mode": "token-mean"}}
    ).algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (3e-4, 1e-3, "token-mean")
    # cispo aggregates per token (MiniMax-M1) and keeps the ordinary clip defaults
    a = build_config({"model": {"path": "m"}, "algorithm": {"policy_loss": "cispo"}}).algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.2, "token-mean")


def test_low_var_kl_is_normalised_to_k3():
    assert build_config({"model": {"path": "m"}, "algorithm": {"kl": {"estimator": "low_var_kl"}}}).algorithm.kl.estimator == "k3"


def test_attention_implementations_transformers_knows_are_accepted_and_others_listed():
    ok = build_config({"model": {"path": "builtin:tiny-qwen2", "attn_implementation": "kernels-community/flash-attn3"}})
    assert ok.model.attn_implementation == "kernels-community/flash-attn3"
    with pytest.raises(UserError, match=r"model.attn_implementation.*unknown attention implementation 'flash2'.*sdpa, eager"):
        build_config({"model": {"path": "builtin:tiny-qwen2", "attn_implementation": "flash2"}})
