"""The calculator task (builtin:tool_arithmetic) as a plain OpenAI-client agent: no postrl import.

postrl calls `run(client, row)` once per rollout sample (`rollout.agent:
examples/openai_agent/calculator_agent.py:run`), with `client` an `openai.OpenAI` whose base_url is
that sample's session on postrl's endpoint, and `row` the dataset row. The same function runs against
any OpenAI-compatible server:

    python examples/openai_agent/calculator_agent.py --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-0.5B-Instruct

It returns None: `reward.verifiers` score the boxed answer the model wrote (configs: math_17k_acc).
"""

from __future__ import annotations

import ast
import json
import operator

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (integers stay exact) and return the result.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10 / 7".'}},
            "required": ["expression"],
        },
    },
}]  # fmt: skip
MAX_TURNS, MAX_TOOL_CALLS = 3, 2  # as configs/tiny_tool_dapo.yaml's rollout.multi_turn

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip


def calculator(expression: str) -> str:
    """Numbers, + - * / // % ** and parentheses, parsed with ast (never eval); errors come back as text."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"'{ast.unparse(node)}' is not allowed: use numbers, + - * / // % **, and parentheses")

    try:
        value = ev(ast.parse(str(expression), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError) as exc:
        return f"error: {exc}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def run(client, row) -> None:
    """One episode: ask, run the calculator for each call, send the results back, until an answer."""
    messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=getattr(client, "model", "policy"), messages=messages, tools=TOOLS)
        if not answer_tools(messages, reply.choices[0].message):
            return None
    return None


async def run_async(client, row) -> None:
    """`run` for an `openai.AsyncOpenAI` client (`rollout.agent: ...calculator_agent.py:run_async`): many
    episodes on one event loop instead of a thread each."""
    messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=getattr(client, "model", "policy"), messages=messages, tools=TOOLS)
        if not answer_tools(messages, reply.choices[0].message):
            return None
    return None


def answer_tools(messages: list[dict], message) -> bool:
    """Append the model's message and, if it called tools (within MAX_TOOL_CALLS), their results; False: done."""
    calls = sum(m["role"] == "tool" for m in messages)
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls or calls >= MAX_TOOL_CALLS:
        return False
    for call in message.tool_calls:
        try:
            args = json.loads(call.function.arguments)
            result = calculator(args["expression"]) if call.function.name == "calculator" else f"error: no tool {call.function.name}"
        except (ValueError, KeyError, TypeError) as exc:
            result = f"error: bad arguments ({exc})"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return True


if __name__ == "__main__":
    import argparse

    import openai

    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--question", default="What is 347 * 28 + 1205?")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="none")
    client.model = a.model
    run(client, {"prompt": [{"role": "user", "content": a.question}]})
