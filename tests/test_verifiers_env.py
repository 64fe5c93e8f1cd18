"""`verifiers` environments as the rollout (agents/verifiers_env.py + verifiers_worker.py).

The environment runs in its own process with an interpreter that has verifiers 0.1.x: `make setup` builds the
side venv `.venv-verifiers` at the repository root (POSTRL_VERIFIERS_PYTHON overrides the path); without it the
tests that need it skip, and say why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VF_PYTHON = os.environ.get("POSTRL_VERIFIERS_PYTHON") or str(ROOT / ".venv-verifiers" / "bin" / "python")
needs_vf = pytest.mark.skipif(
    not Path(VF_PYTHON).exists(),
    reason=f"no verifiers side venv at {VF_PYTHON} (make setup builds it; or set POSTRL_VERIFIERS_PYTHON)",
)
EXAMPLE = ROOT / "examples/verifiers_calculator"


def _example_cfg(tmp_path, *extra: str):
    """examples/verifiers_calculator/ with tiny_tool_dapo's settings, shortened: the random tiny tools model, HF
    rollout, 2 steps of 2 prompts x 2 samples, validation before and after on 4 prompts."""
    from postrl.config import load_config

    return load_config(EXAMPLE / "tiny_tool_dapo_verifiers.yaml", [
        "model.path=builtin:tiny-qwen2-tools", "rollout.engine=hf", "rollout.n_samples_per_prompt=2", "rollout.max_tokens=16",
        f"rollout.environment=verifiers:{EXAMPLE}/calculator_env.py", f"rollout.environment_python={VF_PYTHON}",
        "rollout.environment_args.train_size=64", "rollout.environment_args.eval_size=8", "rollout.agent_concurrency=8",
        "algorithm.filter_groups.enable=false", "algorithm.overlong_buffer.len=4", "train.global_batch_size=2", "train.gen_batch_size=2",
        "train.micro_batch_size=4", "train.total_steps=2", "train.warmup_steps=0", "eval.freq=0", "eval.max_prompts=4", "eval.max_tokens=16",
        f"logging.dir={tmp_path}", "logging.progress=false", "checkpoint.keep_best=null", "checkpoint.save_final=false", *extra,
    ])  # fmt: skip


@needs_vf
def test_the_verifiers_calculator_trains_two_steps_and_logs_its_rubric_reward(tmp_path):
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    cfg = _example_cfg(tmp_path)
    assert cfg.data.train_files == ["verifiers:train"] and cfg.data.val_files == ["verifiers:eval"]
    assert [v.weight for v in cfg.reward.verifiers] == [0.0] and cfg.algorithm.filter_groups.metric == "score"
    Trainer(cfg).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "reward/rubric" in r]
    assert len(steps) == 2
    for r in steps:  # 2 prompts x 2 samples per step, each scored by the rubric (ToolEnv adds its monitors)
        assert (r["rubric/scored"], r["rubric/failed"], r["rubric/function_errors"], r["agent/errors"]) == (4, 0, 0, 0)
        assert 0.0 <= r["reward/rubric"] <= 1.0 and "rubric/correct_answer" in r and "rubric/num_turns" in r
        assert r["rubric/correct_answer"] == r["reward/rubric"]  # the rubric's one weighted function
        assert r["rubric/num_turns"] >= 1 and r["agent/requests_mean"] == r["rubric/num_turns"]
        assert r["response_length/mean"] > 0  # the endpoint's sampled tokens are trained on
    assert len([r for r in rows if "val/calculator_env/score_mean" in r]) == 2  # eval_dataset validates


def test_config_errors_are_one_paragraph_each(tmp_path):
    from postrl.config import RolloutConfig, load_config
    from postrl.errors import UserError

    base = ["model.path=builtin:tiny-qwen2-tools", f"logging.dir={tmp_path}"]
    for extra, words in (
        (["rollout.environment=wordle"], "not of the form 'verifiers:"),
        (["rollout.environment=verifiers:wordle", "rollout.agent=x.py:run"], "rollout.environment and rollout.agent"),
        (["rollout.environment=verifiers:wordle", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[builtin:calculator]"],
         "rollout.environment and rollout.multi_turn.enable"),
    ):  # fmt: skip
        with pytest.raises(UserError) as err:
            load_config(EXAMPLE / "tiny_tool_dapo_verifiers.yaml", base + extra)
        assert words in str(err.value) and "Fix:" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not of the form 'verifiers:"):
        RolloutConfig(environment="verifiers: ")


def test_an_interpreter_without_verifiers_is_named_with_the_fix(tmp_path):
    import sys

    from postrl.agents.verifiers_env import interpreter_problems

    (missing,) = interpreter_problems(str(tmp_path / "nope/bin/python"))
    assert "does not exist" in missing and "postrl[verifiers]" in missing
    if sys.version_info >= (3, 0):  # this venv has no verifiers (it lives in the side venv)
        (without,) = interpreter_problems(sys.executable)
        assert "cannot import verifiers" in without and "rollout.environment_python" in without


@needs_vf
def test_a_failing_environment_is_contained_and_counted_and_a_broken_one_stops_with_exit_2(tmp_path):
    """An environment whose rollout raises, and a rubric function that raises: each sample scores 0, counted, the
    run goes on. One whose load_environment raises stops the run before any rollout, as a UserError."""
    import subprocess
    import sys

    from postrl.agents.verifiers_env import VerifiersAgent
    from postrl.config import RolloutConfig
    from postrl.errors import UserError

    env = tmp_path / "flaky_env.py"
    env.write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n\n"
        "def bad_rubric(completion, answer):\n    raise ValueError('the rubric is broken')\n\n"
        "def load_environment(mode='raise'):\n"
        "    if mode == 'load':\n        raise RuntimeError('cannot load me')\n"
        "    ds = Dataset.from_list([{'question': 'q', 'answer': '1'}])\n"
        "    class Env(vf.SingleTurnEnv):\n"
        "        async def setup_state(self, state):\n"
        "            if mode == 'raise':\n                raise KeyError('the environment is broken')\n"
        "    return Env(dataset=ds, rubric=vf.Rubric(funcs=[bad_rubric]))\n"
    )  # fmt: skip
    with pytest.raises(UserError) as err:
        VerifiersAgent(RolloutConfig(environment=f"verifiers:{env}", environment_args={"mode": "load"}, environment_python=VF_PYTHON))
    assert "did not load: RuntimeError: cannot load me" in str(err.value) and "Fix:" in str(err.value)
    # the same through the CLI: one paragraph, exit 2, no traceback
    cli = subprocess.run(
        [sys.executable, "-m", "postrl.cli", "train", str(EXAMPLE / "tiny_tool_dapo_verifiers.yaml"), "model.path=builtin:tiny-qwen2-tools",
         f"rollout.environment=verifiers:{env}", "rollout.environment_args={mode: load}", f"rollout.environment_python={VF_PYTHON}",
         f"logging.dir={tmp_path}/run", "rollout.engine=hf"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300,
    )  # fmt: skip
    said = " ".join((cli.stdout + cli.stderr).split())  # the console wraps lines
    assert cli.returncode == 2 and "did not load: RuntimeError: cannot load me" in said and "Traceback" not in said
