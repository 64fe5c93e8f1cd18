"""What the built-in tasks and models share: drawing disjoint splits, and the on-disk cache.

Cached artefacts (tiny models, task files) are named by a hash of everything they are built from
(their spec, with a version number that is bumped when the builder's output changes), so a changed
spec never reuses a stale build; each builder writes under a temporary name of its own (pid + random) and
renames it into place atomically, so a crash never leaves a half build that a later run would pick up, and
builders racing on a cold cache (ranks, test workers, two runs) never share a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from postrl.utils import cache_dir, scratch_path


def spec_key(spec: dict) -> str:
    """12 hex digits naming `spec` (order-free)."""
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def task_files(name: str, version: int, generate: Callable[..., dict[str, list[dict]]], knobs: dict) -> dict[str, Path]:
    """Write (or reuse) the parquet files of a built-in task; returns {split: path}.

    `generate(**knobs)` returns the rows of each split; they are cached under
    <cache>/data/<name>-<key of knobs + version>/<split>.parquet.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = cache_dir() / "data" / f"{name}-{spec_key({**knobs, 'version': version})}"
    paths = {s: out / f"{s}.parquet" for s in ("train", "val")}
    if all(p.exists() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    splits = generate(**knobs)
    for split, rows in splits.items():
        tmp = scratch_path(paths[split])
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, paths[split])  # a racing builder's file is the same rows: either one may win
    return paths


def disjoint_splits(
    sizes: dict[str, int], draw: Callable[[], dict], to_row: Callable[[dict, int, str], dict], what: str
) -> dict[str, list[dict]]:
    """Rows of each split, in order, from problems drawn by `draw()` until each split is full; a problem whose
    "signature" was drawn before (in any split) is skipped, so no validation problem occurs in training.

    `to_row(problem, index, split)` makes the row (it may draw from the task's RNG too); `what` says in
    the error what to raise when the space of problems is too small for the sizes.
    """
    splits: dict[str, list[dict]] = {split: [] for split in sizes}
    seen: set[Any] = set()
    for split, size in sizes.items():
        attempts = 0
        while len(splits[split]) < size:
            attempts += 1
            if attempts > 50 * size + 1000:
                raise ValueError(f"cannot draw {size} distinct {split} {what}")
            p = draw()
            if p["signature"] in seen:
                continue
            seen.add(p["signature"])
            splits[split].append(to_row(p, len(splits[split]), split))
    return splits
