"""The calculator task (postrl's builtin:tool_arithmetic) as a `verifiers` environment: a ToolEnv with a
calculator tool and a rubric that pays 1 for the right number in \\boxed{}. No postrl import: it runs in
postrl's worker process with verifiers 0.1.x, and with verifiers' own tools:

    vf-eval calculator_env -m <model> -b http://localhost:8000/v1      # (with this directory on PYTHONPATH)

postrl: `rollout.environment: verifiers:examples/verifiers_calculator/calculator_env.py`
(examples/verifiers_calculator/tiny_tool_dapo_verifiers.yaml). The problems are those of
builtin:tool_arithmetic ("What is 347 * 28 + 1205?"), generated here with the same rule: a 3-digit times a
2-digit number, plus or minus a number of 3 to `max_digits` digits; evaluation expressions never occur in
training.
"""

from __future__ import annotations

import ast
import operator
import random

import verifiers as vf
from datasets import Dataset

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay exact) and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10 / 7".
    """

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


def problems(train_size: int, eval_size: int, max_digits: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval) rows {question, answer}; evaluation expressions never occur in training."""
    rng = random.Random(seed)

    def one() -> tuple[str, str]:
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        c = rng.randint(100, 10 ** rng.randint(3, max_digits) - 1)
        op = rng.choice("+-")
        return f"{a} * {b} {op} {c}", str(a * b + c if op == "+" else a * b - c)

    seen: set[str] = set()
    splits: list[list[dict]] = []
    for size in (eval_size, train_size):
        rows: list[dict] = []
        while len(rows) < size:
            expression, answer = one()
            if expression not in seen:
                seen.add(expression)
                rows.append({"question": f"What is {expression}?", "answer": answer})
        splits.append(rows)
    return splits[1], splits[0]


def correct_answer(completion, answer: str, parser: vf.Parser) -> float:
    """1 when the last \\boxed{} of the model's final answer is the true number, else 0."""
    return 1.0 if parser.parse_answer(completion) == answer else 0.0


def load_environment(train_size: int = 2000, eval_size: int = 300, max_digits: int = 4, seed: int = 1234, max_turns: int = 3) -> vf.Environment:
    """The environment: `max_turns` model turns (as configs/tiny_tool_dapo.yaml's agent loop), the calculator,
    the boxed-answer rubric."""
    train, evaluation = problems(train_size, eval_size, max_digits, seed)
    parser = vf.Parser(extract_fn=vf.extract_boxed_answer)
    rubric = vf.Rubric(funcs=[correct_answer], weights=[1.0], parser=parser)
    return vf.ToolEnv(
        dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(evaluation), tools=[calculator],
        max_turns=max_turns, parser=parser, rubric=rubric,
    )  # fmt: skip
