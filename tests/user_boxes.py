"""A lookup-tool task whose held-out entities lie outside the training entities' range (issue 50, docs/learning.md).

"What is the stock of item box317?" -> the answer in \\boxed{}: a number only the tool knows, as in
tests/user_lookup.py, but the names are `box` and a number: training items box0 .. box299, held-out items
box300 .. box399. Every held-out name starts with a digit (3) that never follows `box` with three more digits
in training (box3, box30 .. box39 do occur; box3NN never), so the copy of an unseen name into the call has to
carry a character sequence RL never rewarded.

    <tool_call>{"name": "lookup", "arguments": {"item": "box317"}}</tool_call>
    <tool_response>4817</tool_response>   (the environment's tokens, masked)
    \\boxed{4817}

SFT data come from a mixed teacher: a fraction `tool_ratio` of the training rows carries the trace above, the
rest a wrong guess (a random number). The reward is `user_tasks:exact_boxed`; the tool `user_boxes:lookup`.

    python tests/user_boxes.py OUT_DIR      writes OUT_DIR/boxes_{train,val}.parquet
    python tests/user_boxes.py OUT_DIR --val 300:1000:3      held-out box300, box303, .. box999 (234 items)
    python tests/user_boxes.py OUT_DIR --train 30:40 --repeats 240 --mix 200:300 --mix-repeats 8
        RL on ten names box30 .. box39, with 800 prompts on box200 .. box299 mixed in (names of the held-out length)
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
from pathlib import Path

TOOL = "lookup"
ITEM = re.compile(r"box[0-9]{1,4}")
HELD_OUT = range(300, 400)  # box300 .. box399


def lookup(item: str) -> str:
    """Look up the stock count of an item.

    Args:
        item: the item's name, e.g. box17
    """
    item = item.strip()
    if not ITEM.fullmatch(item):
        return f"unknown item: {item}"
    return str(int(hashlib.sha256(item.encode()).hexdigest(), 16) % 9000 + 1000)


def make_row(item: str, index: int, split: str, uses_tool: bool, rng: random.Random) -> dict:
    answer = lookup(item)
    if uses_tool:
        call = {"type": "function", "function": {"name": TOOL, "arguments": {"item": item}}}
        trace = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": TOOL, "content": answer},
            {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
        ]
    else:  # a guess: a random number, never the answer
        wrong = rng.choice([n for n in (rng.randint(1000, 9999), rng.randint(1000, 9999)) if str(n) != answer])
        trace = [{"role": "assistant", "content": f"\\boxed{{{wrong}}}"}]
    return {
        "data_source": "user/boxes",
        "prompt": [{"role": "user", "content": f"What is the stock of item {item}?"}],
        "ability": "lookup",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": split, "solution": trace, "item": item},
    }


def rows(
    train_items: range = range(300), val_items: range = HELD_OUT, repeats: int = 8, tool_ratio: float = 0.3, seed: int = 0
) -> dict[str, list[dict]]:
    """Training: box<i> for i in `train_items`, each in `repeats` rows (shuffled); held-out: box<i> for i in `val_items`."""
    if set(train_items) & set(val_items):
        raise ValueError("the held-out items must not occur in training")
    rng = random.Random(f"boxes-{seed}")
    train = [f"box{i}" for i in train_items for _ in range(repeats)]
    rng.shuffle(train)
    return {
        "train": [make_row(item, i, "train", rng.random() < tool_ratio, rng) for i, item in enumerate(train)],
        "val": [make_row(f"box{n}", i, "val", False, rng) for i, n in enumerate(val_items)],
    }


def mixed(mix_items: range | None = None, mix_repeats: int = 8, **knobs) -> dict[str, list[dict]]:
    """`rows(**knobs)`, with box<i> for i in `mix_items` (each in `mix_repeats` rows) shuffled into training."""
    got = rows(**knobs)
    if mix_items is None:
        return got
    more = rows(train_items=mix_items, val_items=knobs.get("val_items", HELD_OUT), repeats=mix_repeats, seed=1)
    train = got["train"] + more["train"]
    random.Random("mix").shuffle(train)
    for index, row in enumerate(train):
        row["extra_info"]["index"] = index
    return {"train": train, "val": got["val"]}


def write(out_dir: str | Path, **knobs) -> dict[str, Path]:
    """boxes_{train,val}.parquet; returns {"boxes_<split>": path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, split_rows in mixed(**knobs).items():
        paths[f"boxes_{split}"] = path = out_dir / f"boxes_{split}.parquet"
        pq.write_table(pa.Table.from_pylist(split_rows), path)
    return paths


def items(text: str) -> range:
    """`A:B` or `A:B:STEP` -> range(A, B, STEP), as Python slices them."""
    return range(*(int(part) for part in text.split(":")))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the boxes task's parquet files.")
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=items, default=range(300), help="training items box<i>, i in A:B[:STEP] (0:300)")
    parser.add_argument("--repeats", type=int, default=8, help="rows per training item (8)")
    parser.add_argument("--val", type=items, default=HELD_OUT, help="held-out items, A:B[:STEP] (300:400)")
    parser.add_argument("--mix", type=items, default=None, help="more training items box<i>, i in A:B[:STEP], shuffled")
    parser.add_argument("--mix-repeats", type=int, default=8, help="rows per --mix item (8)")
    args = parser.parse_args()
    paths = write(
        args.out_dir, train_items=args.train, val_items=args.val, repeats=args.repeats,
        mix_items=args.mix, mix_repeats=args.mix_repeats,
    )
    for name, path in paths.items():
        print(name, path)
