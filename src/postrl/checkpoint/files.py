"""The checkpoint directory's layout, its durable writes and its readable-or-explained reads.

    <checkpoint.dir>/latest_checkpointed_iteration.txt   the tracker: "N", the iteration resume reads
    <checkpoint.dir>/iter_000000N/                       one checkpoint (docs/checkpoints.md: layout)

Writes are fsynced and renamed into place, so a crash never leaves a half file under its real name;
a read that fails names the damaged file and the way back to an intact checkpoint.

Reads never run code from the file: every .pt file loads with `torch.load(weights_only=True)`
(tensors, numbers, strings, containers). What postrl writes is only that (store.py keeps numpy's RNG
key as a tensor). The first format kept that key as a numpy array, which loads with numpy's array
types allowed and nothing else (an array of objects would need more and is refused). Any other file
is refused with what to do instead (`Untrusted`).
"""

from __future__ import annotations

import json
import os
import pickle
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


# The numpy globals of the first format's RNG files (numpy's MT19937 key as an array): enough to rebuild an
# array of numbers, not to call anything else.
_NUMPY_ARRAY = ("_reconstruct", "ndarray", "dtype", "DType")


class Untrusted(UserError):
    """A checkpoint file that holds pickled Python objects beyond tensors and numbers: refused unread."""


def torch_load(path: Path) -> Any:
    """A .pt file of a checkpoint, without running code from it (the module docstring)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        # Reads the names only, calls nothing; a file that is no archive raises here and `read` calls it damaged.
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        if not unsafe:  # damaged, not hostile
            raise exc from None
        allowed = [_numpy_array_global(name) for name in unsafe]
        if None in allowed:
            raise Untrusted(_untrusted(path, unsafe)) from None
        import numpy as np

        numbers = {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG"}  # numeric dtypes only: no objects inside
        try:
            with torch.serialization.safe_globals([*allowed, *numbers]):
                return torch.load(path, weights_only=True)
        except pickle.UnpicklingError:  # e.g. an array of objects
            raise Untrusted(_untrusted(path, unsafe)) from None


def _numpy_array_global(name: str) -> Any:
    """The numpy object `name` names when a first-format RNG file may use it (an array of numbers), else None."""
    import importlib

    module, _, attr = name.rpartition(".")
    if module.split(".")[0] != "numpy" or attr == "ObjectDType":
        return None
    if attr not in _NUMPY_ARRAY and not (module == "numpy.dtypes" and attr.endswith("DType")):
        return None
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _untrusted(path: Path, unsafe: list[str]) -> str:
    names = ", ".join(sorted(unsafe))[:300]
    way = ("resume with checkpoint.load_optimizer: false (fresh optimizer moments, the LR schedule continues) or "
           if path.parent.name in ("optimizer", "critic") or path.name == "scheduler.pt" else
           "resume with checkpoint.load_rng: false (the RNG seeded from train.seed) or " if path.name.startswith("rng_") else "")
    return (f"{path} holds pickled Python objects ({names}), not only tensors and numbers: loading it could run code "
            "from the file, so postrl does not read it (checkpoint state loads with torch.load(weights_only=True); postrl "
            f"never writes such objects). Fix: {way}start from the checkpoint's weights only (safetensors, no code) with "
            "checkpoint.finetune: true, a fresh run at step 0; if you wrote the file yourself, check what wrote those "
            "objects.")


def read(path: Path, load: Callable[[Path], Any]) -> Any:
    """`load(path)`, with a truncated or garbage file reported by name and with the way back."""
    try:
        return load(path)
    except UserError:  # said already (e.g. Untrusted)
        raise
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
