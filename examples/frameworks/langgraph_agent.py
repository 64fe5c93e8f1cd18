"""The calculator task (builtin:tool_arithmetic) as LangGraph's prebuilt ReAct agent over langchain-openai's
ChatOpenAI: `rollout.agent: examples/frameworks/langgraph_agent.py:run` (tests/test_frameworks.py trains it 2 steps).

ChatOpenAI talks to the sample's session through its own `openai` client (base_url and api_key from the one postrl
hands the program). It returns None: `reward.verifiers` score the text the model wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "openai_agent"))  # the calculator of examples/openai_agent/
from calculator_agent import call_tool  # noqa: E402


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay exact) and return the result."""
    return call_tool("calculator", json.dumps({"expression": expression}))


def run(client, row):
    llm = ChatOpenAI(model=client.model, base_url=str(client.base_url), api_key=client.api_key, max_retries=0, temperature=1.0)
    agent = create_react_agent(llm, [calculator])
    agent.invoke({"messages": row["prompt"]}, {"recursion_limit": 7})  # at most 3 model turns
    return None
