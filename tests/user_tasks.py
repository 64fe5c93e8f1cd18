"""Three tasks of a user's own, unlike the built-in arithmetic, written as a user would bring them:
verl-schema parquet files and a reward as `user_tasks:<function>` (docs/learning.md).

- reverse: "Reverse the list: 4 7 1 9"                 -> "\\boxed{9 1 7 4}"
- count:   "How many times does 7 occur in: 7 3 7 1 5?" -> "\\boxed{2}"
- largest: "Which number is the largest: 12 45 7 33?"  -> "\\boxed{45}"

Two more with little headroom (issue 28: after a short SFT the greedy answer is mostly right, samples
at T 0.6 much less often, and pass@8 is close to greedy; RL can only sharpen):

- sort:      "Sort the list: 4 7 1 9 1"               -> "\\boxed{1 1 4 7 9}"
- increment: "Add 1 to each number: 3 5 8"           -> "\\boxed{4 6 9}"

Each row's reference solution (extra_info.solution, for `postrl sft`) is the correct answer. Train
and held-out rows are disjoint (no held-out list occurs in training).

    python tests/user_tasks.py OUT_DIR      writes OUT_DIR/<task>_{train,val}.parquet
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

TASKS = ("reverse", "count", "largest")
LOW_HEADROOM = ("sort", "increment")


def _numbers(rng: random.Random, task: str) -> list[int]:
    if task == "reverse":
        return [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
    if task == "sort":
        return [rng.randint(0, 9) for _ in range(rng.randint(5, 7))]
    if task == "increment":
        return [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    if task == "count":
        return [rng.choice([rng.randint(0, 9), 7]) for _ in range(rng.randint(4, 7))]
    return [rng.randint(1, 60) for _ in range(rng.randint(3, 5))]


def make_row(task: str, numbers: list[int], index: int, split: str) -> dict:
    listed = " ".join(map(str, numbers))
    if task == "reverse":
        question, answer = f"Reverse the list: {listed}", " ".join(map(str, reversed(numbers)))
    elif task == "sort":
        question, answer = f"Sort the list: {listed}", " ".join(map(str, sorted(numbers)))
    elif task == "increment":
        question, answer = f"Add 1 to each number: {listed}", " ".join(str(n + 1) for n in numbers)
    elif task == "count":
        question, answer = f"How many times does 7 occur in: {listed}?", str(numbers.count(7))
    else:
        question, answer = f"Which number is the largest: {listed}?", str(max(numbers))
    return {
        "data_source": f"user/{task}",
        "prompt": [{"role": "user", "content": question}],
        "ability": "lists",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": split, "solution": f"\\boxed{{{answer}}}"},
    }


def rows(task: str, train_size: int = 4000, val_size: int = 300, seed: int = 0) -> dict[str, list[dict]]:
    rng = random.Random(f"{task}-{seed}")
    seen: set[tuple[int, ...]] = set()
    out: dict[str, list[dict]] = {"val": [], "train": []}
    for split, size in (("val", val_size), ("train", train_size)):
        while len(out[split]) < size:
            numbers = _numbers(rng, task)
            key = tuple(numbers)
            if key in seen:
                continue
            seen.add(key)
            out[split].append(make_row(task, numbers, len(out[split]), split))
    return out


def write(out_dir: str | Path, **sizes: int) -> dict[str, Path]:
    """<task>_{train,val}.parquet for every task (TASKS and LOW_HEADROOM); returns {"<task>_<split>": path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for task in TASKS + LOW_HEADROOM:
        for split, split_rows in rows(task, **sizes).items():
            paths[f"{task}_{split}"] = path = out_dir / f"{task}_{split}.parquet"
            pq.write_table(pa.Table.from_pylist(split_rows), path)
    return paths


def _boxed(completion: str) -> str | None:
    found = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    return " ".join(found[-1].split()) if found else None


def exact_boxed(completion: str, ground_truth: str, row: dict) -> dict:
    """1 when the last \\boxed{} holds exactly the answer (whitespace normalised), else 0."""
    ok = float(_boxed(completion) == " ".join(str(ground_truth).split()))
    return {"score": ok, "acc": ok}


if __name__ == "__main__":
    for name, path in write(sys.argv[1]).items():
        print(name, path)
