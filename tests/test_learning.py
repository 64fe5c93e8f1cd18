"""The `make run` pipeline, shortened: SFT warm start, then DAPO lifts held-out greedy accuracy.

configs/tiny_sft.yaml trains on a mixed teacher's solutions (worked ones, and bare answers of
which half are hasty and wrong); the SFT model answers tersely and is often wrong. DAPO with the
boxed-answer reward has to discover that working the problem out pays. Measured: about 14% greedy
accuracy after SFT and about 50% after 10 DAPO steps (README, "What make run shows"). The SFT
stage is the full one: after 300 steps the worked style is still too weak for a 15-point gain in
12 RL steps (measured 7.5% -> 16.5%).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from postrl.checks import load_config
from postrl.metrics import read_jsonl
from postrl.sft import run_sft
from postrl.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _held_out(run_dir: Path) -> list[float]:
    return [r["val/arithmetic/acc_mean@1"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val/arithmetic/acc_mean@1" in r]


def _rl_run(config: str, sft_model: Path, run_dir: Path, *extra: str) -> Path:
    """15 steps of `configs/<config>` from the SFT model, validated before and after on 200 prompts; the run dir."""
    cfg = load_config(
        CONFIGS / config,
        [
            f"model.path={sft_model}", "train.total_steps=15", "eval.freq=0", "eval.max_prompts=200",
            f"logging.dir={run_dir}", "logging.progress=false", *extra,
        ],
    )  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.engine.close()
    return run_dir


@pytest.mark.slow
def test_sft_then_dapo_lifts_held_out_greedy_accuracy_by_15_points(sft_model, tmp_path):
    val = _held_out(_rl_run("tiny_dapo.yaml", sft_model, tmp_path / "rl"))
    before, after = val[0], val[-1]
    assert len(val) == 2 and before < 0.35, val  # the SFT model mostly answers tersely (and hastily)
    assert after - before >= 0.15, val


@pytest.mark.slow
def test_grpo_through_lora_adapters_lifts_held_out_accuracy_by_15_points(sft_model, tmp_path):
    """The GRPO recipe training rank-16 adapters only (the base frozen, the KL reference the base itself),
    at the 10x learning rate LoRA wants. Measured: 14.3% -> 45.3% after 10 steps, 47.3% after 30."""
    cfg = load_config(
        CONFIGS / "tiny_grpo.yaml",
        [
            f"model.path={sft_model}", "model.lora_rank=16", "model.lora_alpha=32", "train.lr=5e-4",
            "algorithm.kl.coef=0.001", "train.total_steps=12", "eval.freq=0", "eval.max_prompts=200",
            f"logging.dir={tmp_path}/rl", "logging.progress=false", "checkpoint.keep_best=null",
        ],
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    assert sum(p.numel() for p in trainer.actor.params) < 0.2 * sum(p.numel() for p in trainer.model.parameters())
    rows = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert next(r["actor/kl_loss"] for r in rows if r.get("training/step") == 1) == 0.0
    val = _held_out(tmp_path / "rl")
    assert len(val) == 2 and val[-1] - val[0] >= 0.15, val


@pytest.mark.slow
def test_on_a_users_own_task_the_dapo_recipe_ends_no_worse_than_its_start(tmp_path):
    """Issue 15's case: a task of the user's own (reverse a list; verl parquet + a `module:function`
    reward), a short SFT on correct references, then the shipped DAPO recipe for 30 steps. At the old
    rollout temperature 1.0 this ended below its start (GRPO: 84.0% -> 73.3%); the recipe's 0.6 keeps
    the policy's samples close to its greedy answers (docs/learning.md)."""
    import user_tasks

    files = user_tasks.write(tmp_path / "data", train_size=4000, val_size=300)
    data = [f"data.train_files=[{files['reverse_train']}]", f"data.val_files=[{files['reverse_val']}]",
            "reward.verifiers=[user_tasks:exact_boxed]"]  # fmt: skip
    run_sft(load_config(CONFIGS / "tiny_sft.yaml", [
        *data, "sft.steps=150", "sft.warmup_steps=30", "sft.eval_prompts=0", f"sft.output_dir={tmp_path}/sft",
        f"logging.dir={tmp_path}/sft", "logging.progress=false",
    ]))  # fmt: skip
    cfg = load_config(CONFIGS / "tiny_dapo.yaml", [
        *data, f"model.path={tmp_path}/sft/model", f"logging.dir={tmp_path}/rl", "logging.progress=false",
    ])  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    val = [r["val/reverse_val/acc_mean@1"] for r in read_jsonl(tmp_path / "rl" / "metrics.jsonl") if "val/reverse_val/acc_mean@1" in r]
    assert len(val) == 4 and val[0] > 0.5, val  # start, steps 10 and 20, the end
    assert val[-1] >= val[0] - 0.01, val
    best = (tmp_path / "rl" / "checkpoints" / "best" / "best.json").read_text()
    assert f'"value": {max(val)}' in best


@pytest.fixture(scope="module")
def increment_sft(tmp_path_factory) -> tuple[Path, list[str]]:
    """A low-headroom task of the user's own (issue 28): `increment` after 170 SFT steps answers about 90%
    greedily, samples 88% right at T 0.6, and pass@8 is 97% (6 points above greedy). The model, and the
    data / reward overrides of the runs from it."""
    import user_tasks

    tmp = tmp_path_factory.mktemp("increment")
    files = user_tasks.write(tmp / "data", train_size=4000, val_size=300)
    data = [f"data.train_files=[{files['increment_train']}]", f"data.val_files=[{files['increment_val']}]",
            "reward.verifiers=[user_tasks:exact_boxed]"]  # fmt: skip
    run_sft(load_config(CONFIGS / "tiny_sft.yaml", [
        *data, "sft.steps=170", "sft.warmup_steps=34", "sft.eval_prompts=0", f"sft.output_dir={tmp}/sft",
        f"logging.dir={tmp}/sft", "logging.progress=false",
    ]))  # fmt: skip
    return tmp / "sft" / "model", data


@pytest.mark.slow
def test_on_a_low_headroom_task_the_grpo_recipe_ends_no_worse_than_its_start(increment_sft, tmp_path):
    """Issue 28: with little headroom the sampled reward rose while held-out greedy accuracy fell below the
    start (sort: 42.3% -> 40.3%, 38.0% at step 10). The recipe's KL to the SFT reference holds the greedy
    answers' log-probs, and checkpoint.end_with_best ends the run with the best weights when the last
    validation falls anyway. Measured: 90.3% -> 91.7%, 92.7%, 90.7%: ends with step 20's (92.7%)."""
    model, data = increment_sft
    cfg = load_config(CONFIGS / "tiny_grpo.yaml", [
        *data, f"model.path={model}", f"logging.dir={tmp_path}/rl", "logging.progress=false",
    ])  # fmt: skip
    Trainer(cfg).fit()
    rows = [r for r in read_jsonl(tmp_path / "rl" / "metrics.jsonl") if "val/increment_val/acc_mean@1" in r]
    val = [r["val/increment_val/acc_mean@1"] for r in rows]
    assert len(val) == 4 and val[0] > 0.7, val  # start, steps 10 and 20, the end (as measured, before any back-off)
    best = json.loads((tmp_path / "rl" / "checkpoints" / "best" / "best.json").read_text())
    ended = best["value"] if rows[-1].get("training/back_off") else val[-1]  # the accuracy of the weights it ends with
    assert ended >= val[0] - 0.01, val


@pytest.fixture(scope="module")
def tiny_rm(sft_model, tmp_path_factory) -> tuple[Path, dict]:
    """`postrl rm configs/tiny_rm.yaml` on the built-in pairs, its body the SFT model above."""
    from postrl.rm import run_rm

    tmp = tmp_path_factory.mktemp("rm")
    cfg = load_config(CONFIGS / "tiny_rm.yaml", [f"model.path={sft_model}", f"rm.output_dir={tmp}", f"logging.dir={tmp}", "logging.progress=false"])
    return tmp / "model", run_rm(cfg)


@pytest.mark.slow
def test_rm_on_the_built_in_pairs_ranks_90_percent_of_held_out_pairs(tiny_rm):
    assert tiny_rm[1]["rm/val_accuracy"] >= 0.9, tiny_rm[1]


@pytest.mark.slow
def test_dapo_with_the_rm_as_only_reward_lifts_rule_checked_accuracy_by_15_points(sft_model, tiny_rm, tmp_path):
    """configs/tiny_rm_dapo.yaml: the RM is the whole reward (the rule has weight 0); validation is rule-checked."""
    _rl_run("tiny_rm_dapo.yaml", sft_model, tmp_path / "rl", f"reward.reward_model.path={tiny_rm[0]}", "checkpoint.keep_best=null")
    rows = [r for r in read_jsonl(tmp_path / "rl" / "metrics.jsonl") if "training/step" in r]
    assert all(r["dapo/rule_score/mean"] == 0.0 for r in rows)  # the rule is logged, never rewarded
    val = _held_out(tmp_path / "rl")
    assert len(val) == 2 and val[-1] - val[0] >= 0.15, val


@pytest.mark.slow
def test_judge_scores_a_real_models_judgements_and_counts_the_unparsed(sft_model):
    """The SFT model as judge: asked the question ({prompt}), it answers \\boxed{n} (measured: 5, 1, 0 and 11
    for these four). The pattern takes two-digit answers only, so some judgements parse and some score the
    fail value; the counts and scores follow the judge's own text."""
    import re

    import torch

    from postrl.config import JudgeConfig, RewardConfig
    from postrl.rewards import RewardFunction
    from postrl.rewards.judge import Judge

    questions = ["Tom has 3 apples. He buys 2 more. How many now?", "Eva has 9 books. She loses 4. She finds 2 more. How many now?",
                 "hello there", "Sam has 4 cards. He wins 8 more. He loses 6. How many now?"]  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in questions]
    cfg = JudgeConfig(path=str(sft_model), prompt_template="{prompt}", score_pattern=r"\\boxed\{(\d\d)\}", max_tokens=24, fail_score=-1.0)
    judge = Judge(cfg, torch.device("cpu"))
    texts = judge.judgements(["x"] * 4, ["5"] * 4, rows)
    found = [re.search(r"\\boxed\{(\d\d)\}", t) for t in texts]
    expected = [float(m.group(1)) if m else -1.0 for m in found]
    with RewardFunction(RewardConfig(verifiers=["math_17k_acc"]), models=[judge]) as fn:
        out = fn(["x"] * 4, ["5"] * 4, rows)
    assert out.metrics["judge_score"] == expected
    assert out.failures["reward/judge_unparsed"] == sum(m is None for m in found)
    assert 0 < sum(m is None for m in found) < 4, texts  # both kinds occur
