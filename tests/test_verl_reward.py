"""verl users' reward files run unchanged (issue 48): `custom_reward_function.path` + `.name` with verl's signature
compute_score(data_source, solution_str, ground_truth, extra_info) become a postrl verifier that runs in the
verifier worker pool under reward.timeout_s; `postrl train SCRIPT.sh` trains from a verl script directly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from postrl.checks import validate_tree
from postrl.cli import main
from postrl.errors import UserError
from postrl.guides import convert_verl
from postrl.rewards.registry import RewardFunction

VERL = Path(__file__).resolve().parent / "guides_inputs" / "verl"
REWARD = VERL / "gsm8k_reward.py"


def _row(source: str, truth, index: int) -> dict:
    return {"data_source": source, "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "train", "index": index}}


def _reward_cfg(name: str = "compute_score", *more: str):
    conv = convert_verl(["actor_rollout_ref.model.path=m", f"custom_reward_function.path={REWARD}", f"custom_reward_function.name={name}",
                         "reward_model.reward_manager=naive", *more])  # fmt: skip
    return conv, validate_tree(conv.tree)


def test_the_keys_become_a_verifier_that_replaces_the_managers_default():
    conv, cfg = _reward_cfg()
    assert [(v.name, v.weight) for v in cfg.reward.verifiers] == [(f"verl:{REWARD}:compute_score", 1.0)]
    assert not [u for u in conv.unmapped if u.source.startswith("custom_reward_function")]


def test_verl_signature_in_the_worker_pool_with_extra_info_as_verl_passes_it():
    _, cfg = _reward_cfg()
    rows = [_row("openai/gsm8k", "72", 3), _row("openai/gsm8k", "72", 4), _row("openai/gsm8k", ["a", "b"], 5)]
    with RewardFunction(cfg.reward) as reward:
        out = reward(["so #### 72", "#### 71", "#### 1"], ["72", "72", "['a', 'b']"], rows)
    assert out.scores == [1.0, 0.0, 0.0] and out.metrics["acc"] == [1.0, 0.0, 0.0]
    assert (out.errors, out.invalid, out.timeouts) == (0, 0, 0)
    # the verdicts carry the dict's numbers; extra_info held the row's own plus num_turns / rollout_reward_scores
    name = cfg.reward.verifiers[0].name
    assert out.metrics[name] == [1.0, 0.0, 0.0]
    with RewardFunction(cfg.reward) as reward:
        results, _, _ = reward._verdicts(["#### 72"] * 2, ["72"] * 2, rows[:1] + rows[2:])
    [r0, r2] = results[0]
    assert (r0.metrics["index_seen"], r2.metrics["index_seen"]) == (3.0, 5.0)
    assert (r0.metrics["truth_is_list"], r2.metrics["truth_is_list"]) == (0.0, 1.0)  # ground_truth as stored, not str()
    assert r0.metrics["pid"] != os.getpid() and "pred" not in r0.metrics  # ran in a worker process; strings stay out


def test_a_bare_float_and_the_time_limit():
    _, cfg = _reward_cfg("length_score")
    cfg.reward.timeout_s = 1.0
    with RewardFunction(cfg.reward) as reward:
        out = reward(["x" * 50] * 4, ["1"] * 4, [_row("a", "1", i) for i in range(4)])
    assert out.scores == [0.5] * 4
    _, cfg = _reward_cfg()
    cfg.reward.timeout_s = 1.0
    with RewardFunction(cfg.reward) as reward:
        out = reward(["#### 1"] * 5, ["1"] * 5, [_row("slow" if i == 0 else "x", "1", i) for i in range(5)])
    assert (out.timeouts, out.scores) == (1, [0.0, 1.0, 1.0, 1.0, 1.0])  # the slow call scores the fail score, counted


@pytest.mark.parametrize("name, message", [("nope", "has no function 'nope'"), ("_bad", "does not take data_source")])
def test_a_wrong_name_or_signature_is_a_config_error(name, message, tmp_path):
    bad = tmp_path / "r.py"
    bad.write_text("def _bad(completion, ground_truth, row):\n    return 1.0\n")
    conv = convert_verl(["actor_rollout_ref.model.path=m", f"custom_reward_function.path={bad}", f"custom_reward_function.name={name}"])
    with pytest.raises(UserError, match=message):
        validate_tree(conv.tree)


def test_reward_kwargs_reach_the_function_as_verl_binds_them():
    conv, cfg = _reward_cfg("scaled_score", "+custom_reward_function.reward_kwargs.scale=3.0",
                            "+custom_reward_function.reward_kwargs.format_bonus.value=0.25")  # fmt: skip
    assert cfg.reward.verifiers[0].kwargs == {"scale": 3.0, "format_bonus": {"value": 0.25}}
    assert not [u for u in conv.unmapped if u.source.startswith("custom_reward_function")]
    with RewardFunction(cfg.reward) as reward:  # in the worker pool, as any verl reward file
        out = reward(["#### 72", "#### 71", "seventy-two"], ["72"] * 3, [_row("openai/gsm8k", "72", i) for i in range(3)])
    assert out.scores == [3.25, 0.25, 0.0] and out.errors == 0
    _, whole = _reward_cfg("scaled_score", "+custom_reward_function.reward_kwargs={scale: 2}")  # one mapping, as in YAML
    assert whole.reward.verifiers[0].kwargs == {"scale": 2}


def test_a_reward_kwarg_the_function_does_not_take_is_a_config_error():
    conv = convert_verl(["actor_rollout_ref.model.path=m", f"custom_reward_function.path={REWARD}",
                         "custom_reward_function.reward_kwargs.scael=2"])  # fmt: skip
    with pytest.raises(UserError, match=r"kwargs scael, which its function compute_score\(data_source"):
        validate_tree(conv.tree)


@pytest.mark.slow
def test_train_takes_a_verl_script(tmp_path, capsys):
    """`postrl train SCRIPT.sh`: converted in memory, the mapping printed, the overrides after it applied."""
    run = tmp_path / "run"
    argv = ["train", str(VERL / "tiny_custom_reward.sh"), "--env", f"REWARD_FILE={REWARD}", "trainer.total_training_steps=2",
            "data.builtin.train_size=16", "eval.after_train=false", "logging.progress=false", f"logging.dir={run}"]  # fmt: skip
    assert main(argv) == 2  # the reward file is the user's code: nothing of a script runs unless allowed
    printed = " ".join(capsys.readouterr().out.split())
    assert f"reward.verifiers[0] = 'verl:{REWARD}:compute_score': imports and calls this reward function" in printed
    assert "run again with --allow-code" in printed and not (run / "metrics.jsonl").exists()
    assert main([*argv, "--allow-code"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "# from custom_reward_function.path" in printed and "max_tokens: 12 # from data.max_response_length" in printed
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # trainer.total_training_steps=2 after the script wins over its 5
    assert all(f"grpo/verl:{REWARD}:compute_score/mean" in r for r in rows)  # the user's file scored every step
    cfg = validate_tree(__import__("yaml").safe_load((run / "converted_from_verl.yaml").read_text()))
    assert (cfg.algorithm.clip_ratio_high, cfg.algorithm.loss_agg_mode, cfg.rollout.max_tokens) == (0.28, "token-mean", 12)
