"""`builtin:<task>:<split>` data files: the built-in tasks written once as parquet in the verl schema."""

from __future__ import annotations

from pathlib import Path

from postrl.builtin import arithmetic, cache, shapes, tool_arithmetic
from postrl.errors import UserError

TASKS = {"arithmetic": arithmetic, "shapes": shapes, "tool_arithmetic": tool_arithmetic}  # TASK_VERSION, generate_splits


def task_files(task: str, knobs: dict) -> dict[str, Path]:
    """Write (or reuse) the parquet files of the built-in `task` built with `knobs`; returns {split: path}."""
    return cache.task_files(task, TASKS[task].TASK_VERSION, TASKS[task].generate_splits, knobs)


def task_file(path: str, knobs: dict[str, dict | None]) -> Path:
    """The parquet file of `builtin:<task>:<split>`, built with `knobs[task]` (None: the task's defaults)."""
    parts = path.split(":")
    if len(parts) != 3 or parts[0] != "builtin" or parts[1] not in TASKS or parts[2] not in ("train", "val"):
        raise UserError(
            f"unknown built-in data set '{path}'; use 'builtin:arithmetic:train' / ':val' (text) or "
            "'builtin:shapes:train' / ':val' (images), or 'builtin:tool_arithmetic:train' / ':val' (tools)."
        )
    return task_files(parts[1], knobs.get(parts[1]) or {})[parts[2]]
