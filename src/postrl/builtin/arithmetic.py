"""Built-in task: synthetic arithmetic word problems with answers in \\boxed{}.

"Mia has 23 marbles. She finds 14 more. She gives away 5. How many now?"
-> "23+14=37. 37-5=32. \\boxed{32}"

Prompts and solutions are kept short on purpose: on a 2-core CPU the cost of an RL step is the
number of tokens it processes.

Two answer styles, as in distilled SFT data from a mixed teacher: a worked solution (above) and a
bare answer ("\\boxed{32}"). A fraction `terse_ratio` of the training rows carries the bare answer as
its reference solution, and a fraction `hasty_ratio` of those bare answers is wrong the way a hasty
solver is wrong: it stops before the last step ("\\boxed{37}"). Worked solutions are always right.
The SFT model inherits the mix, and RL with the verifiable reward has something real to learn: that
working the problem out pays. Rewards and validation always use the true answer.

Problems are deterministic from a seed. Train and validation are disjoint: no validation problem's
numbers-and-operations signature appears in training. Rows are written as parquet in the verl schema,
so the trainer reads them like any user data set.
"""

from __future__ import annotations

import random
import re

from postrl.builtin import cache

TASK_VERSION = 2  # bump when the text of problems or solutions changes (invalidates the cache)
NAMES = ["Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Leo", "Zoe", "Max", "Eva", "Noah", "Ivy"]
PRONOUN = {n: ("She" if n in {"Anna", "Lily", "Mia", "Zoe", "Eva", "Ivy"} else "He") for n in NAMES}
ITEMS = ["apples", "books", "coins", "marbles", "stickers", "pencils", "cards", "shells", "stamps", "cookies"]
ADD_STEPS = ["{p} buys {x} more.", "{p} finds {x} more.", "{p} gets {x} more.", "{p} wins {x} more."]
SUB_STEPS = ["{p} gives away {x}.", "{p} loses {x}.", "{p} sells {x}.", "{p} uses {x}."]


def make_problem(rng: random.Random, max_value: int, n_operands: int, subtraction: bool) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    pronoun = PRONOUN[name]
    total = rng.randint(1, max_value)
    sentences = [f"{name} has {total} {item}."]
    steps, signature = [], [total]
    for _ in range(n_operands - 1):
        before_last = total
        x = rng.randint(1, max_value)
        if subtraction and total >= 1 and rng.random() < 0.4:
            x = rng.randint(1, total)
            sentences.append(rng.choice(SUB_STEPS).format(p=pronoun, x=x))
            steps.append(f"{total}-{x}={total - x}.")
            signature += ["-", x]
            total -= x
        else:
            sentences.append(rng.choice(ADD_STEPS).format(p=pronoun, x=x))
            steps.append(f"{total}+{x}={total + x}.")
            signature += ["+", x]
            total += x
    sentences.append("How many now?")
    return {
        "question": " ".join(sentences),
        "solution": " ".join(steps) + f" \\boxed{{{total}}}",
        "terse_solution": f"\\boxed{{{total}}}",
        "hasty_solution": f"\\boxed{{{before_last}}}",  # a hasty solver stops before the last step
        "answer": str(total),
        "signature": tuple(signature),
    }


def to_verl_row(problem: dict, index: int, split: str, style: str = "solution", instruction: str = "") -> dict:
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"{problem['question']} {instruction}".strip()}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": problem["answer"]},
        "extra_info": {
            "index": index,
            "split": split,
            "solution": problem[style],
        },
    }


def generate_splits(
    train_size: int,
    val_size: int,
    max_value: int = 60,
    min_operands: int = 2,
    max_operands: int = 3,
    subtraction: bool = True,
    terse_ratio: float = 0.0,
    hasty_ratio: float = 0.0,
    seed: int = 1234,
    instruction: str = "",
) -> dict[str, list[dict]]:
    """Rows of both splits; validation signatures never occur in training. `instruction` follows each question
    (a pretrained instruct model is told how to answer; the tiny models learn it from SFT instead)."""
    rng = random.Random(seed)

    def to_row(p: dict, index: int, split: str) -> dict:
        style = "solution"
        if split == "train" and rng.random() < terse_ratio:
            style = "hasty_solution" if rng.random() < hasty_ratio else "terse_solution"
        return to_verl_row(p, index, split, style, instruction)

    return cache.disjoint_splits(
        {"val": val_size, "train": train_size},
        lambda: make_problem(rng, max_value, rng.randint(min_operands, max_operands), subtraction),
        to_row,
        f"problems with max_value={max_value} and {min_operands}-{max_operands} operands; raise max_value or max_operands",
    )


def tokenizer_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Text to train the tiny tokenizer on: task problems and solutions plus general arithmetic."""
    rng = random.Random(seed)
    texts = ["system\nYou are a helpful assistant.", "user\n", "assistant\n"] * 50
    for _ in range(n):
        p = make_problem(rng, 99, rng.randint(2, 4), True)
        texts.append(p["question"])
        texts.append(p["solution"])
    return texts


# ------------------------------------------------------------------------- preference pairs (RM)
_START = re.compile(r"^\w+ has (\d+) ")
_STEP = re.compile(r"\b(buys|finds|gets|wins|gives away|loses|sells|uses) (\d+)\b")
_SUBTRACT = {"gives away", "loses", "sells", "uses"}


def worked_steps(question: str) -> list[tuple[int, str, int, int]]:
    """(before, op, x, after) of each step of a problem, read back from its text."""
    total = int(_START.match(question).group(1))
    steps = []
    for verb, x in _STEP.findall(question):
        op, x = ("-" if verb in _SUBTRACT else "+"), int(x)
        after = total - x if op == "-" else total + x
        steps.append((total, op, x, after))
        total = after
    return steps


def _worked(steps: list[tuple[int, str, int, int]], boxed: int) -> str:
    return " ".join(f"{a}{op}{x}={b}." for a, op, x, b in steps) + f" \\boxed{{{boxed}}}"


def preference_pair(row: dict, rng: random.Random) -> dict:
    """A TRL-style pair for one arithmetic row: chosen, the correct worked solution; rejected, a wrong answer.

    Wrong answers as the mixed SFT teacher writes them: the hasty bare answer (the total before the
    last step), or a bare answer off by 1-3. (Worked solutions with a slip, or a box that disagrees
    with the last step, were tried too: in 150 steps the tiny RM ranked them at chance, 37-56%.)
    """
    question = row["prompt"][-1]["content"]
    steps = worked_steps(question)
    answer = steps[-1][3]
    off = answer + rng.choice([k for k in (-3, -2, -1, 1, 2, 3) if answer + k >= 0])
    kind = rng.choice(["hasty", "off_by_k"])
    rejected = f"\\boxed{{{steps[-1][0] if kind == 'hasty' else off}}}"
    return {"prompt": row["prompt"], "chosen": _worked(steps, answer), "rejected": rejected, "kind": kind}


def preference_pairs(rows: list[dict], seed: int = 0) -> list[dict]:
    """One pair per row (`preference_pair`); train pairs from train rows, held-out pairs from val rows."""
    rng = random.Random(seed)
    return [preference_pair(row, rng) for row in rows]
