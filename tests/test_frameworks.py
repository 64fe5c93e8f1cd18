"""Real agent frameworks, unchanged, trained through postrl's endpoint (rollout.agent): examples/frameworks/ on the
calculator recipe (examples/openai_agent/tiny_tool_dapo_agent.yaml) shortened to 2 steps of 2 prompts x 2 samples on
the random tiny tools model with HF rollout. The frameworks are the `frameworks` extra (`make test` installs it);
without one its test skips and says so."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import AGENT_RECIPE, tiny_agent_overrides

ROOT = Path(__file__).resolve().parents[1]


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed (pip install 'postrl[frameworks]')")


def _train(tmp_path, program: str, *extra: str) -> list[dict]:
    from postrl.checks import load_config
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    cfg = load_config(AGENT_RECIPE, tiny_agent_overrides(
        tmp_path, f"{ROOT / 'examples/frameworks' / program}:run", "rollout.max_tokens=32", "rollout.agent_timeout_s=120",
        "eval.before_train=false", "eval.after_train=false", "checkpoint.end_with_best=null", *extra,
    ))  # fmt: skip
    Trainer(cfg).fit()
    return [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "timing/all" in r]


def _trained_through_the_endpoint(steps: list[dict]) -> None:
    assert len(steps) == 2
    for r in steps:  # 2 prompts x 2 samples, each program's requests answered and its tokens trained
        assert r["agent/requests_mean"] >= 1 and r["agent/bad_requests"] == 0 and r["response_length/mean"] > 0
        assert r["agent/errors"] + r["agent/timeouts"] <= 1, r  # a random model's odd tool call may fail one sample


@_needs("agents")
@pytest.mark.slow
def test_an_openai_agents_sdk_agent_trains_two_steps_through_the_endpoint(tmp_path):
    _trained_through_the_endpoint(_train(tmp_path, "agents_sdk_agent.py"))


@_needs("langgraph")
@_needs("langchain_openai")
@pytest.mark.slow
def test_a_langgraph_react_agent_over_langchain_openai_trains_two_steps_through_the_endpoint(tmp_path):
    _trained_through_the_endpoint(_train(tmp_path, "langgraph_agent.py"))


@_needs("smolagents")
@pytest.mark.slow
def test_smolagents_prompt_past_the_tiny_models_context_stops_the_run_with_the_refusal(tmp_path):
    """smolagents' system prompt (~2.5K tokens) does not fit the 512 + 32 tokens of this run: every request is
    refused with a 400 that says so, and the run stops after the first batch with that error and the fix."""
    from postrl.errors import UserError

    with pytest.raises(UserError) as err:
        _train(tmp_path, "smolagents_agent.py")
    said = str(err.value)
    assert "failed on 4 of the 4 samples of this batch" in said and "\n" not in said, said
    assert "context" in said and "Fix" in said, said
