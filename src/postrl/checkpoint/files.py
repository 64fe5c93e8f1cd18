"""The checkpoint directory's layout, its durable writes and its readable-or-explained reads.

    <checkpoint.dir>/latest_checkpointed_iteration.txt   the tracker: "N", the iteration resume reads
    <checkpoint.dir>/iter_000000N/                       one checkpoint (docs/checkpoints.md: layout)

Writes are fsynced and renamed into place, so a crash never leaves a half file under its real name;
a read that fails names the damaged file and the way back to an intact checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from postrl.errors import UserError
from postrl.utils import scratch_path

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"


def iter_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def iter_step(path: Path) -> int | None:
    """N of an iter_N directory; None for any other name."""
    name = path.name
    if not name.startswith("iter_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def complete_iters(root: Path) -> list[Path]:
    """The complete iter_* checkpoints under `root`, oldest first."""
    found = [(s, p) for p in root.glob("iter_*") if (s := iter_step(p)) is not None and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def read_tracker(root: Path) -> int:
    """The iteration the tracker file of checkpoint directory `root` names."""
    tracker = root / TRACKER
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise UserError(
            f"{tracker} holds '{text}', not an iteration number. "
            "Fix: write the step of an existing iter_* directory into it (e.g. 10 for iter_0000010)."
        )
    return int(text)


def describe(path: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint (for tools and tests)."""
    return json.loads((Path(path) / STATE_FILE).read_text())


# ---------------------------------------------------------------------------------- durable writes


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(d)
    fsync_dir(path)


def write_atomic(path: Path, text: str) -> None:
    tmp = scratch_path(path)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Delete a directory so that no reader ever sees it half-deleted under its own name."""
    if not path.exists():
        return
    trash = path.with_name(f".del_{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


# ------------------------------------------------------------------------------------------ reads


def torch_load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def read(path: Path, load: Callable[[Path], Any]) -> Any:
    """`load(path)`, with a truncated or garbage file reported by name and with the way back."""
    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - torch / safetensors / pickle each raise their own types
        ckpt = next((p for p in [path, *path.parents] if iter_step(p) is not None), None)
        if ckpt is None:  # a model directory, not a checkpoint
            raise UserError(
                f"{path} is damaged and cannot be read ({type(exc).__name__}: {exc}). "
                "Fix: restore the file from its source (re-export or re-download the model)."
            ) from None
        earlier = [p.name for p in complete_iters(ckpt.parent) if (iter_step(p) or 0) < (iter_step(ckpt) or 0)]
        way_back = (
            f"the earlier checkpoint {earlier[-1]} is intact: write {iter_step(ckpt.parent / earlier[-1])} into "
            f"{ckpt.parent / TRACKER} and run the same command again to resume from it"
            if earlier
            else "no earlier checkpoint exists: set checkpoint.resume=none to start over (or restore the file)"
        )
        raise UserError(
            f"{path} is damaged and cannot be read ({type(exc).__name__}: {str(exc)[:200]}), so checkpoint {ckpt.name} "
            f"cannot be resumed from. Fix: {way_back}."
        ) from None
