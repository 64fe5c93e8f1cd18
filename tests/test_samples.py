"""Samples a user can read (src/postrl/samples.py): rollouts and validation generations as JSONL, full agent
trajectories turn by turn, read back after a tiny agent run and after a scripted tool-calling loop."""

from __future__ import annotations

import pytest
from conftest import tiny_overrides
from test_agents import _call, _loop, _prompt

from postrl.metrics import read_jsonl
from postrl.rollout.base import SamplingParams
from postrl.samples import SampleWriter, read_samples, split_turns

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AGENT = ("model.path=builtin:tiny-qwen2-tools", "data.train_files=[builtin:tool_arithmetic:train]",
         "data.val_files=[builtin:tool_arithmetic:val]", "data.tool_arithmetic.train_size=64",
         "data.tool_arithmetic.val_size=6", "rollout.multi_turn.enable=true",
         "rollout.multi_turn.tools=[builtin:calculator]", "rollout.multi_turn.max_turns=2")  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from postrl.builtin.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model("tiny-qwen2-tools"))


def test_a_tool_trajectory_is_written_turn_by_turn_with_its_call_and_the_tools_answer(tokenizer, tmp_path):
    from postrl.checks import load_config
    from postrl.data.dataset import PromptExample

    loop, _ = _loop(tokenizer, [_call("347 * 28 + 1205", ""), "\\boxed{10921}<|im_end|>"])
    prompt = _prompt(tokenizer)
    (c,) = loop.generate([prompt], SamplingParams(max_tokens=200, greedy=True))
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2-tools", f"logging.dir={tmp_path}", "logging.samples.print_val=1"])
    printed = []
    writer = SampleWriter(cfg, tokenizer, printed.append)
    writer.for_validation(7)("tool_arithmetic", [PromptExample(prompt, "10921", {}, "x")], [c], [1.0], [1.0])
    (row,) = read_samples(tmp_path / "samples" / "val_step_7.jsonl")
    assert [t["role"] for t in row["turns"]] == ["assistant", "tool", "assistant"]
    assert row["turns"][0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "347 * 28 + 1205"}}]
    assert "10921" in row["turns"][1]["text"] and row["turns"][2]["tool_calls"] == []
    assert row["response"].endswith("\\boxed{10921}") and "What is 347 * 28 + 1205?" in row["prompt"]
    assert (row["step"], row["acc"], row["ground_truth"], row["tool_calls"], row["set"]) == (7, 1.0, "10921", 1, "tool_arithmetic")
    assert len(printed) == 1 and printed[0].row_count == 1  # print_val: one row of a rich table


def test_turns_follow_the_loss_mask_and_a_single_turn_is_one_assistant_turn(tokenizer):
    ids = tokenizer("ab", add_special_tokens=False)["input_ids"]
    assert [t["role"] for t in split_turns(tokenizer, ids, None)] == ["assistant"]
    two = ids + ids + ids
    turns = split_turns(tokenizer, two, [1] * len(ids) + [0] * len(ids) + [1] * len(ids))
    assert [t["role"] for t in turns] == ["assistant", "environment", "assistant"]  # no call before it: not a tool's answer


def test_a_tiny_agent_run_writes_every_rollout_and_validation_generation(tmp_path):
    """2 steps of the agent loop with the samples on: a rollout file per step with the whole batch, a validation
    file per validation with every held-out prompt, and their rewards and accuracies are the logged metrics'."""
    from postrl.checks import load_config
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(tmp_path, *AGENT, "train.total_steps=2", "eval.before_train=true",
                                           "eval.after_train=true", "logging.samples.rollout_freq=1", "logging.samples.print_val=2"))  # fmt: skip
    Trainer(cfg).fit()
    run = tmp_path / "run"
    rows = read_jsonl(run / "metrics.jsonl")
    samples = run / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["rollout_step_1.jsonl", "rollout_step_2.jsonl", "val_step_0.jsonl", "val_step_2.jsonl"]
    for step in (1, 2):
        lines = read_samples(samples / f"rollout_step_{step}.jsonl")
        logged = next(r for r in rows if r["step"] == step and "grpo/rewards/mean" in r)
        assert len(lines) == cfg.train.global_batch_size * cfg.rollout.n_samples_per_prompt
        assert sum(x["reward"] for x in lines) / len(lines) == pytest.approx(logged["grpo/rewards/mean"])
        assert {x["step"] for x in lines} == {step} and {x["version"] for x in lines} == {step - 1}  # sync: the weights before the step
        assert [x["group"] for x in lines] == [i // 4 for i in range(16)]
        for x in lines:
            assert x["turns"][0]["role"] == "assistant" and x["response"] == "".join(t["text"] for t in x["turns"] if t["role"] == "assistant")
    for step in (0, 2):
        lines = read_samples(samples / f"val_step_{step}.jsonl")
        logged = next(r for r in rows if r["step"] == step and "val/tool_arithmetic/acc_mean@1" in r)
        assert len(lines) == 6 and {x["set"] for x in lines} == {"tool_arithmetic"}
        assert sum(x["acc"] for x in lines) / 6 == pytest.approx(logged["val/tool_arithmetic/acc_mean@1"])
        assert all(x["ground_truth"] and "What is" in x["prompt"] for x in lines)


def test_verls_sample_keys_turn_the_samples_on():
    from postrl.checks import load_config
    from postrl.guides import convert_verl

    flat = convert_verl(["trainer.rollout_data_dir=/data/rollouts", "trainer.validation_data_dir=/data/val",
                         "trainer.log_val_generations=5"]).flat()  # fmt: skip
    assert flat == {"logging.samples.rollout_freq": 1, "logging.samples.val": True, "logging.samples.print_val": 5}
    assert convert_verl(["trainer.rollout_data_dir=null", "trainer.validation_data_dir=null"]).flat() == {
        "logging.samples.rollout_freq": 0, "logging.samples.val": False}  # fmt: skip
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "trainer.rollout_data_dir=/x", "trainer.log_val_generations=3"])
    assert (cfg.logging.samples.rollout_freq, cfg.logging.samples.val, cfg.logging.samples.print_val) == (1, True, 3)
