"""The `make run` pipeline, shortened: SFT warm start, then DAPO lifts held-out greedy accuracy.

configs/tiny_sft.yaml trains on a mixed teacher's solutions (worked ones, and bare answers of
which half are hasty and wrong); the SFT model answers tersely and is often wrong. DAPO with the
boxed-answer reward has to discover that working the problem out pays. Measured: about 14% greedy
accuracy after SFT and about 50% after 10 DAPO steps (README, "What make run shows"). The SFT
stage is the full one: after 300 steps the worked style is still too weak for a 15-point gain in
12 RL steps (measured 7.5% -> 16.5%).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from postrl.config import load_config
from postrl.metrics import read_jsonl
from postrl.sft import run_sft
from postrl.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    """The `make run` SFT stage, whole: the warm start of the RL tests below."""
    tmp = tmp_path_factory.mktemp("sft")
    run_sft(load_config(CONFIGS / "tiny_sft.yaml", ["sft.eval_prompts=0", f"sft.output_dir={tmp}", f"logging.dir={tmp}"]))
    return tmp / "model"


def _held_out(run_dir: Path) -> list[float]:
    return [r["val/arithmetic/acc_mean@1"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val/arithmetic/acc_mean@1" in r]


@pytest.mark.slow
def test_sft_then_dapo_lifts_held_out_greedy_accuracy_by_15_points(sft_model, tmp_path):
    cfg = load_config(
        CONFIGS / "tiny_dapo.yaml",
        [
            f"model.path={sft_model}", "train.total_steps=15", "eval.freq=0", "eval.max_prompts=200",
            f"logging.dir={tmp_path}/rl", "logging.progress=false",
        ],
    )  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.engine.close()
    val = _held_out(tmp_path / "rl")
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


@pytest.mark.slow
def test_with_a_calculator_dapo_lifts_held_out_accuracy_and_the_tool_call_rate(tmp_path):
    """The tool demo, shortened (docs/agents.md): SFT on a mixed teacher (30% calculator traces, 70% wrong
    guesses), then DAPO through the agent loop. The SFT model mostly guesses, so greedy decoding never
    calls the tool; RL makes calling it the greedy answer. Measured with the full recipe: held-out greedy
    accuracy 0.0% -> 47.7% after 10 steps, the tool-call ratio 0% -> 100%. This test took 12.4 minutes on
    the shared 2-core machine (load ~4.5), most of it the whole SFT stage (400 steps)."""
    run_sft(load_config(CONFIGS / "tiny_tool_sft.yaml", [
        "sft.eval_prompts=0", f"sft.output_dir={tmp_path}/sft", f"logging.dir={tmp_path}/sft", "logging.progress=false",
    ]))  # fmt: skip
    cfg = load_config(CONFIGS / "tiny_tool_dapo.yaml", [
        f"model.path={tmp_path}/sft/model", "train.total_steps=10", "eval.freq=0", "eval.max_prompts=200",
        f"logging.dir={tmp_path}/rl", "logging.progress=false", "checkpoint.keep_best=null",
    ])  # fmt: skip
    Trainer(cfg).fit()
    rows = [r for r in read_jsonl(tmp_path / "rl" / "metrics.jsonl") if "val/tool_arithmetic/acc_mean@1" in r]
    acc = [r["val/tool_arithmetic/acc_mean@1"] for r in rows]
    calls = [r["val/tool_arithmetic/tool_call_ratio"] for r in rows]
    assert len(acc) == 2 and acc[0] < 0.2, acc  # the SFT model mostly guesses
    assert acc[1] - acc[0] >= 0.15 and calls[1] > calls[0], (acc, calls)
    steps = [r for r in read_jsonl(tmp_path / "rl" / "metrics.jsonl") if "agent/turns_mean" in r]
    assert steps and all(r["agent/tool_error"] + r["agent/tool_timeout"] <= r["agent/tool_ok"] for r in steps)
