"""The calculator task (builtin:tool_arithmetic) as an OpenAI Agents SDK agent: `rollout.agent:
examples/frameworks/agents_sdk_agent.py:run` (tests/test_frameworks.py trains it 2 steps).

An async function, so postrl hands it an `openai.AsyncOpenAI` pointed at the sample's session; the SDK's
chat-completions model wraps that client (the Responses API is not what postrl's endpoint serves). Tracing is
off: it would upload to OpenAI. It returns None: `reward.verifiers` score the text the model wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "openai_agent"))  # the calculator of examples/openai_agent/
from calculator_agent import call_tool  # noqa: E402


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay exact) and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10 / 7".
    """
    import json

    return call_tool("calculator", json.dumps({"expression": expression}))


async def run(client, row):
    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model=client.model, openai_client=client)
    agent = Agent(name="calc", instructions="Use the calculator, then give the answer in \\boxed{}.", tools=[calculator],
                  model=model, model_settings=ModelSettings(temperature=1.0))  # fmt: skip
    await Runner.run(agent, row["prompt"][-1]["content"], max_turns=3)
    return None
