"""Completions in DAPO-Math-17k's answer format, written from MATH-500's reference solutions and answers.

DAPO-Math-17k's prompts end with "Answer: $Answer"; a model that obeys writes its answer on an
`Answer:` line, with or without a box. Each case is (style, row, ground-truth row): the completion is
built from `row`, scored against the answer of `ground-truth row` (the next row's: a wrong answer).
"""

from __future__ import annotations

import json
from pathlib import Path

MATH500 = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "math500_test.jsonl"
N_ROWS = 120  # the first rows of MATH-500: every subject, ~20 s of scoring

STYLES = {
    # the prompt's format, no box: a boxed-only reader (MindSpeed-RL's math_17k_acc) finds no answer
    "answer_line": lambda r: f"We compute step by step and simplify.\n\nAnswer: {r['answer']}",
    # the prompt's format with the answer boxed
    "answer_boxed": lambda r: f"We compute step by step and simplify.\n\nAnswer: \\boxed{{{r['answer']}}}",
    # the reference solution (boxed) followed by the Answer line
    "solution_then_answer": lambda r: f"{r['solution']}\n\nAnswer: {r['answer']}",
    # the reference solution alone
    "solution": lambda r: r["solution"],
}


def load_rows() -> list[dict]:
    return [json.loads(line) for line in MATH500.read_text().splitlines()[:N_ROWS]]


def cases(rows: list[dict]):
    """(style, completion, ground truth, case id) for every style, right and wrong answers."""
    for style, make in STYLES.items():
        for i, row in enumerate(rows):
            for j in (i, (i + 1) % len(rows)):
                yield style, make(row), rows[j]["answer"], f"{style}:{i}:{j}"
