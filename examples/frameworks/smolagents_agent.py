"""The calculator task as a smolagents ToolCallingAgent: `rollout.agent: examples/frameworks/smolagents_agent.py:run`.

smolagents' own system prompt is about 2.5K tokens: a model whose context (data.max_prompt_length +
rollout.max_tokens) is smaller gets every request refused with a 400 that says so, and the run stops after the
first batch with that error (tests/test_frameworks.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "openai_agent"))  # the calculator of examples/openai_agent/
from calculator_agent import call_tool  # noqa: E402


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly (integers stay exact) and return the result."
    inputs = {"expression": {"type": "string", "description": 'Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10 / 7".'}}
    output_type = "string"

    def forward(self, expression: str) -> str:
        import json

        return call_tool("calculator", json.dumps({"expression": expression}))


def run(client, row):
    model = OpenAIServerModel(model_id=client.model, api_base=str(client.base_url), api_key=client.api_key)
    ToolCallingAgent(tools=[Calculator()], model=model, max_steps=3).run(row["prompt"][-1]["content"])
    return None
