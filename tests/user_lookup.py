"""A user's own lookup-tool task with the shape of issue 40 (docs/learning.md "Held-out collapse on agent tasks").

"What is the stock of item K7-204?" -> the answer in \\boxed{}: a number only the tool knows.

    <tool_call>{"name": "lookup", "arguments": {"code": "K7-204"}}</tool_call>
    <tool_response>4817</tool_response>   (the environment's tokens, masked)
    \\boxed{4817}

The tool (`user_lookup:lookup`, a `module:function` tool as a user writes one) answers from a hash of the
item code, so no model can know the number: it can only call the tool with the exact code and copy the
result. Training prompts repeat a few hundred item codes; the held-out prompts name codes that never
occur in training, so held-out accuracy measures whether the model copies a *new* code into the call.

SFT data come from a mixed teacher, as the built-in tool task's: a fraction `tool_ratio` of the training
rows carries the tool-using trace above, the rest a wrong guess (a random number). The reward is
`user_tasks:exact_boxed`.

    python tests/user_lookup.py OUT_DIR      writes OUT_DIR/lookup_{train,val}.parquet
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
from pathlib import Path

TOOL = "lookup"
CODE = re.compile(r"[A-Z][0-9]-[0-9]{3}")
LETTERS = "ABCDEFGHJKLMNPRSTUVWXZ"


def lookup(code: str) -> str:
    """Look up the stock count of an item.

    Args:
        code: the item code, e.g. K7-204
    """
    code = code.strip()
    if not CODE.fullmatch(code):
        return f"unknown item: {code}"
    return str(int(hashlib.sha256(code.encode()).hexdigest(), 16) % 9000 + 1000)


def _codes(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        code = f"{rng.choice(LETTERS)}{rng.randint(0, 9)}-{rng.randint(0, 999):03d}"
        if code not in taken:
            taken.add(code)
            out.append(code)
    return out


def make_row(code: str, index: int, split: str, uses_tool: bool, rng: random.Random) -> dict:
    answer = lookup(code)
    if uses_tool:
        call = {"type": "function", "function": {"name": TOOL, "arguments": {"code": code}}}
        trace = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": TOOL, "content": answer},
            {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
        ]
    else:  # a guess: a random number, never the answer
        wrong = rng.choice([n for n in (rng.randint(1000, 9999), rng.randint(1000, 9999)) if str(n) != answer])
        trace = [{"role": "assistant", "content": f"\\boxed{{{wrong}}}"}]
    return {
        "data_source": "user/lookup",
        "prompt": [{"role": "user", "content": f"What is the stock of item {code}?"}],
        "ability": "lookup",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": split, "solution": trace, "code": code},
    }


def rows(entities: int = 300, repeats: int = 8, val_size: int = 100, tool_ratio: float = 0.3, seed: int = 0) -> dict[str, list[dict]]:
    """Training: `entities` codes, each in `repeats` rows (shuffled); held-out: `val_size` codes never in training."""
    rng = random.Random(f"lookup-{seed}")
    taken: set[str] = set()
    val_codes, train_codes = _codes(rng, val_size, taken), _codes(rng, entities, taken)
    train = [c for c in train_codes for _ in range(repeats)]
    rng.shuffle(train)
    return {
        "train": [make_row(c, i, "train", rng.random() < tool_ratio, rng) for i, c in enumerate(train)],
        "val": [make_row(c, i, "val", False, rng) for i, c in enumerate(val_codes)],
    }


def write(out_dir: str | Path, **knobs) -> dict[str, Path]:
    """lookup_{train,val}.parquet; returns {"lookup_<split>": path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, split_rows in rows(**knobs).items():
        paths[f"lookup_{split}"] = path = out_dir / f"lookup_{split}.parquet"
        pq.write_table(pa.Table.from_pylist(split_rows), path)
    return paths


if __name__ == "__main__":
    for name, path in write(sys.argv[1]).items():
        print(name, path)
