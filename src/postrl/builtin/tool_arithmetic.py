"""Built-in task where tools matter: arithmetic with numbers too large to work out in the head.

"What is 347 * 28 + 1205?" -> the answer in \\boxed{}: 10921.

The tiny model cannot multiply a 3-digit by a 2-digit number by itself, but with the calculator it
only has to copy: the expression from the question into a tool call, the tool's result into the box.

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28 + 1205"}}</tool_call>
    <tool_response>10921</tool_response>   (the environment's tokens, masked)
    \\boxed{10921}

SFT data come from a mixed teacher, as in the arithmetic demo: a fraction `tool_ratio` of the
training rows carries a tool-using trace (the messages above, with an assistant `tool_calls` turn and a
`tool` turn), the rest a guess: the answer rounded to two significant digits (wrong by construction).
The SFT model mostly guesses and sometimes calls the tool; RL with the boxed-answer reward finds that
calling it pays. Rewards and validation always use the true answer. Train and validation are
disjoint (no validation expression occurs in training).
"""

from __future__ import annotations

import random

from postrl.builtin import cache

TASK_VERSION = 1  # bump when the text of problems or solutions changes (invalidates the cache)
TOOL = "calculator"  # `builtin:calculator`: calculator(expression: str)


def make_problem(rng: random.Random, max_digits: int) -> dict:
    """a * b + c or a * b - c with a 3-digit a, a 2-digit b and a c of 3..max_digits digits."""
    a, b = rng.randint(100, 999), rng.randint(11, 99)
    c = rng.randint(100, 10 ** rng.randint(3, max_digits) - 1)
    op = rng.choice("+-")
    expression = f"{a} * {b} {op} {c}"
    answer = a * b + c if op == "+" else a * b - c
    return {"question": f"What is {expression}?", "expression": expression, "answer": str(answer), "signature": expression}


def guess(answer: int) -> int:
    """A hasty estimate: the answer rounded to two significant digits, never the answer itself."""
    scale = 10 ** max(len(str(abs(answer))) - 2, 0)
    g = round(answer / scale) * scale
    return g if g != answer else g + scale


def tool_trace(problem: dict) -> list[dict]:
    """The turns after the prompt of a teacher that uses the calculator (chat messages with a tool call)."""
    call = {"type": "function", "function": {"name": TOOL, "arguments": {"expression": problem["expression"]}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": TOOL, "content": problem["answer"]},
        {"role": "assistant", "content": f"\\boxed{{{problem['answer']}}}"},
    ]


def guess_trace(problem: dict) -> list[dict]:
    """The turn of a teacher that answers at once, from a rough estimate (wrong)."""
    return [{"role": "assistant", "content": f"\\boxed{{{guess(int(problem['answer']))}}}"}]


def to_verl_row(problem: dict, index: int, split: str, uses_tool: bool) -> dict:
    trace = tool_trace(problem) if uses_tool else guess_trace(problem)
    return {
        "data_source": "tool_arithmetic",
        "prompt": [{"role": "user", "content": problem["question"]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": problem["answer"]},
        # `postrl sft` reads a list of messages as a trace: assistant tokens are trained, tool turns masked.
        "extra_info": {"index": index, "split": split, "solution": trace},
    }


def generate_splits(train_size: int, val_size: int, tool_ratio: float = 0.3, max_digits: int = 4, seed: int = 1234) -> dict[str, list[dict]]:
    """Rows of both splits; validation expressions never occur in training."""
    rng = random.Random(seed)

    def to_row(p: dict, index: int, split: str) -> dict:
        return to_verl_row(p, index, split, uses_tool=split == "train" and rng.random() < tool_ratio)

    return cache.disjoint_splits(
        {"val": val_size, "train": train_size}, lambda: make_problem(rng, max_digits), to_row, "expressions"
    )


def tokenizer_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Text of problems, tool calls, tool responses and answers (the tools tokenizer's training text)."""
    import json

    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        p = make_problem(rng, 4)
        args = json.dumps({"name": TOOL, "arguments": {"expression": p["expression"]}})
        texts += [p["question"], args, f"\\boxed{{{p['answer']}}}", "Tools: calculator, python", "error: timeout"]
    return texts
