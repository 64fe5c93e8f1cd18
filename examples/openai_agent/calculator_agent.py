"""The calculator task (builtin:tool_arithmetic) as a plain OpenAI-client agent: no postrl import.

postrl calls `run(client, row)` once per rollout sample (`rollout.agent:
examples/openai_agent/calculator_agent.py:run`), with `client` an `openai.OpenAI` whose base_url is
that sample's session on postrl's endpoint, and `row` the dataset row. The same function runs against
any OpenAI-compatible server:

    python examples/openai_agent/calculator_agent.py --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-0.5B-Instruct

It returns None: `reward.verifiers` score the boxed answer the model wrote (configs: math_17k_acc).

The episode is the one configs/tiny_tool_dapo.yaml's agent loop runs with `builtin:calculator`, so the
two train alike (tests/test_learning.py compares them): the same tool schema, the same result and error
texts, the same limits (3 model turns, 2 calls, 4 calls per turn, results cut to 32 of the model's
tokens); the response budget across turns (`rollout.max_tokens`) is the endpoint's. One difference is
the chat API's: a malformed call (not JSON) comes back as text, not as a tool call, so the episode ends
there, where the loop answers it with a format hint.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import threading

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
# as configs/tiny_tool_dapo.yaml's rollout.multi_turn (max_parallel_calls: the loop's default)
MAX_TURNS, MAX_TOOL_CALLS, MAX_PARALLEL_CALLS, MAX_TOOL_RESPONSE_TOKENS = 3, 2, 4, 32

MAX_INT_BITS, MAX_EXPR_CHARS, MAX_EXPR_DEPTH = 4096, 1000, 200
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalcError(ValueError):
    pass


def _bits(x):
    return x.bit_length() if isinstance(x, int) else math.log2(abs(x)) + 1 if x else 0.0


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * _bits(left) > MAX_INT_BITS:  # 2**99999999: bound it first
                raise CalcError(f"the result of {left}**{right} is too large (limit: {MAX_INT_BITS} bits)")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise CalcError("the result is a complex number")
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise CalcError(f"the result is too large (limit: {MAX_INT_BITS} bits)")
        if isinstance(result, float) and not math.isfinite(result):
            raise CalcError("the result is not a finite number")
        return result
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"the name '{node.id}'"
    elif isinstance(node, ast.Call):
        what = "a function call"
    elif isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    raise CalcError(f"{what} is not allowed: use numbers, + - * / // % **, and parentheses")


def calculator(expression: str) -> str:
    """Numbers, + - * / // % ** and parentheses, parsed with ast (never eval); errors come back as text."""
    if not isinstance(expression, str):
        return f"expression must be a string, got {type(expression).__name__}"
    if len(expression) > MAX_EXPR_CHARS:
        return f"the expression is too long ({len(expression)} characters; limit {MAX_EXPR_CHARS})"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        todo, deepest = [(tree, 1)], 0
        while todo:  # how deeply it nests, without recursion
            node, d = todo.pop()
            deepest = max(deepest, d)
            todo.extend((child, d + 1) for child in ast.iter_child_nodes(node))
        if deepest > MAX_EXPR_DEPTH:
            raise RecursionError
        value = _eval(tree)
    except SyntaxError as exc:
        return f"not an arithmetic expression: {exc.msg}"
    except (CalcError, ArithmeticError, ValueError) as exc:  # ZeroDivisionError, OverflowError, ...
        return f"{type(exc).__name__ if not isinstance(exc, CalcError) else 'error'}: {exc}"
    except (RecursionError, MemoryError):
        return "the expression is nested too deeply"
    return repr(value) if isinstance(value, float) else str(value)


def call_tool(name: str, arguments: str) -> str:
    """The text one tool call returns to the model (never raises)."""
    if name != "calculator":
        return f"unknown tool '{name}'; available tools: calculator"
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        return f"the arguments of '{name}' are not valid JSON ({exc})"
    if not isinstance(args, dict):
        return f"the arguments of '{name}' must be a JSON object, got {type(args).__name__}"
    problems = ["missing required argument 'expression'"] if "expression" not in args else []
    for key, value in args.items():
        if key != "expression":
            problems.append(f"unknown argument '{key}' (arguments: expression)")
        elif not isinstance(value, str):
            problems.append(f"argument 'expression' must be string, got {type(value).__name__} {value!r:.40}")
    if problems:
        return f"cannot call '{name}': " + "; ".join(problems)
    return calculator(args["expression"])


_tokenizers: dict = {}
_lock = threading.Lock()


def cut(text: str, model: str) -> str:
    """`text` cut to MAX_TOOL_RESPONSE_TOKENS tokens of the model's tokenizer (by characters, 4 a token, without
    transformers or when the model name is not a tokenizer), with a note that says so."""
    with _lock:  # one tokenizer shared by the episodes' threads
        if model not in _tokenizers:
            try:
                from transformers import AutoTokenizer

                _tokenizers[model] = AutoTokenizer.from_pretrained(model)
            except Exception:  # noqa: BLE001 - no transformers, or a served name that is not a tokenizer
                _tokenizers[model] = None
        tok = _tokenizers[model]
        if tok is None:
            n = 4 * MAX_TOOL_RESPONSE_TOKENS
            return text if len(text) <= n else text[:n] + f"\n[output cut at {MAX_TOOL_RESPONSE_TOKENS} tokens]"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= MAX_TOOL_RESPONSE_TOKENS:
            return text
        return tok.decode(ids[:MAX_TOOL_RESPONSE_TOKENS]) + f"\n[output cut at {MAX_TOOL_RESPONSE_TOKENS} tokens]"


def run(client, row) -> None:
    """One episode: ask, run the calculator for each call, send the results back, until an answer."""
    model = getattr(client, "model", "policy")
    messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
    calls = 0
    for turn in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        calls = answer_tools(messages, reply.choices[0].message, turn, calls, model)
        if calls is None:
            return None
    return None


async def run_async(client, row) -> None:
    """`run` for an `openai.AsyncOpenAI` client (`rollout.agent: ...calculator_agent.py:run_async`): many
    episodes on one event loop instead of a thread each."""
    model = getattr(client, "model", "policy")
    messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
    calls = 0
    for turn in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        calls = answer_tools(messages, reply.choices[0].message, turn, calls, model)
        if calls is None:
            return None
    return None


def answer_tools(messages: list[dict], message, turn: int, calls: int, model: str) -> int | None:
    """Append the model's message and the results of the calls it made (within the limits); return the calls
    run so far, or None: the episode is over (an answer, or calls the limits leave unanswered)."""
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls or turn == MAX_TURNS - 1 or calls >= MAX_TOOL_CALLS:
        return None
    for k, call in enumerate(message.tool_calls):
        if k >= MAX_PARALLEL_CALLS:
            result = f"at most {MAX_PARALLEL_CALLS} tool calls per turn; this one was not run"
        elif calls >= MAX_TOOL_CALLS:
            result = f"the limit of {MAX_TOOL_CALLS} tool calls is reached; answer without tools"
        else:
            calls += 1
            result = call_tool(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": cut(result, model)})
    return calls


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
