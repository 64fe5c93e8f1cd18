"""examples/openai_agent/ is the tool demo (configs/tiny_tool_dapo.yaml) written as a plain openai-client program:
its recipe carries the loop recipe's settings, and the program's episode has the loop's limits and tool texts, so
the two can be compared (tests/test_learning.py trains both)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from postrl.checks import load_config

ROOT = Path(__file__).resolve().parents[1]
LOOP, AGENT = ROOT / "configs/tiny_tool_dapo.yaml", ROOT / "examples/openai_agent/tiny_tool_dapo_agent.yaml"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("calculator_agent_example", ROOT / "examples/openai_agent/calculator_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_endpoint_recipe_differs_from_the_loop_recipe_only_in_how_it_rolls_out(example):
    loop, agent = (load_config(p, check_paths=False).model_dump() for p in (LOOP, AGENT))
    mt = loop["rollout"]["multi_turn"]
    assert mt["enable"] and mt["tools"] == ["builtin:calculator"] and agent["rollout"]["agent"].endswith("calculator_agent.py:run")
    # the program's own limits are the loop's
    assert (example.MAX_TURNS, example.MAX_TOOL_CALLS, example.MAX_PARALLEL_CALLS, example.MAX_TOOL_RESPONSE_TOKENS) == (
        mt["max_turns"], mt["max_tool_calls"], mt["max_parallel_calls"], mt["max_tool_response_tokens"])  # fmt: skip
    assert mt["max_response_tokens"] is None  # the budget across turns is rollout.max_tokens in both
    for cfg in (loop, agent):
        cfg["logging"].pop("dir"), cfg["checkpoint"].pop("dir")  # runs/<name>/checkpoints
        for key in [k for k in cfg["rollout"] if k == "multi_turn" or k.startswith("agent")]:
            cfg["rollout"].pop(key)
    assert loop == agent


def test_the_example_calculator_answers_as_the_builtin_one(example):
    from postrl.agents.tools.tools import call_tool, load_tools

    tools = load_tools(["builtin:calculator"])
    assert example.TOOLS == [tools["calculator"].schema]  # the same schema, so the same rendered prompt
    cases = [
        ("calculator", {"expression": e}) for e in ("347 * 28 + 1205", "10/4", "1024/2", "2**100", "2**5000", "1/0", "x+1", "3 +",
                                                     "foo(2)", "-5 % 3", "1e308*10", "True+1", "'a'", "(" * 300 + "1" + ")" * 300, "9" * 1001)
    ] + [("calculator", {}), ("calculator", {"expression": 5}), ("calculator", {"expression": "1", "x": 2}), ("python", {"code": "1"})]  # fmt: skip
    import json

    for name, args in cases:
        assert example.call_tool(name, json.dumps(args)) == call_tool(tools, name, args).text, (name, args)


def test_the_example_cuts_tool_results_as_the_loop_does(example):
    from transformers import AutoTokenizer

    from postrl.agents.loop.render import truncate_text
    from postrl.builtin.tiny import build_tiny_model

    path = str(build_tiny_model("tiny-qwen2-tools"))
    tok = AutoTokenizer.from_pretrained(path)
    for text in ("10921", "error: a function call is not allowed: use numbers, + - * / // % **, and parentheses", "7" * 200):
        assert example.cut(text, path) == truncate_text(tok, text, example.MAX_TOOL_RESPONSE_TOKENS)
    assert example.cut("7" * 200, path) != "7" * 200  # it does cut
