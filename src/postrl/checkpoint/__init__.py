"""Checkpoints: save, exact resume, export and the best weights (user guide: docs/checkpoints.md).

    <checkpoint.dir>/
      latest_checkpointed_iteration.txt      "N"; edit it to resume from another iteration
      iter_0000010/
        model/                 Hugging Face format (config, generation config, safetensors, tokenizer); merged with LoRA
        adapter/               model.lora_rank > 0: the LoRA adapters (peft format), what resume loads
        optimizer/rank{r}.pt   AdamW state (moments, step counts, param-group hyperparameters)
        scheduler.pt           LR scheduler state
        rng_rank{r}.pt         python / numpy / torch (and CUDA) RNG states of rank r
        dataloader.pt          prompt sampler position (epoch, offset); dynamic sampling draws from it
        trainer_state.json     step, batch settings, optimizer hyperparameters, data size (written last)
        config.yaml            the resolved config of the run that wrote the checkpoint
      best/                    checkpoint.keep_best: the weights of the best validation (best.py)

One job per module: files.py (layout, durable writes, damaged-file reads), store.py (writing one
checkpoint), restore.py (resume, loading weights, the metrics to replay), exporter.py (`postrl
export`), best.py (the best weights), lock.py (the run directory). This file publishes a written
checkpoint and names the API. The trainer owns the state; this package owns the files.

Crash safety. A checkpoint is written into `.tmp_iter_N`, every file is fsynced, the directory is
renamed to `iter_N` (atomic), and only then is the tracker file replaced (atomically) to name it.
Resume reads only the tracker, so a crash at any moment leaves the previous checkpoint as the one
`resume: auto` picks up, and a half-written `.tmp_*` directory is never read (the next save removes
it). Rotation renames a checkpoint to `.del_iter_N` before deleting it, so a crash mid-delete never
leaves a half checkpoint under an `iter_*` name either.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from postrl import distributed
from postrl.checkpoint.best import BEST, back_off_line, best_dir, best_so_far, fell_below_best, load_best, keep_if_best, save_best
from postrl.checkpoint.exporter import export, model_dtype, resolve_model_dir
from postrl.checkpoint.files import STATE_FILE, TRACKER, Untrusted, complete_iters, describe, fsync_dir, fsync_tree, iter_dir, read_tracker
from postrl.checkpoint.files import write_atomic as _write_atomic
from postrl.checkpoint.lock import RunLock, check_run_dirs
from postrl.checkpoint.restore import Restored, find_resume_dir, load_adapter, load_model, load_weights, report, resume, setting_changes, stopped_line
from postrl.checkpoint.store import CRASH_ENV, FORMAT_VERSION, clean_leftovers, disk_full, rotate, saved_at, tmp_dir, write_iteration
from postrl.errors import UserError

__all__ = [
    "BEST", "CRASH_ENV", "FORMAT_VERSION", "STATE_FILE", "TRACKER", "Restored", "RunLock", "Untrusted", "back_off_line", "best_dir",
    "best_so_far", "check_run_dirs", "describe", "export", "fell_below_best", "find_resume_dir", "iter_dir", "keep_if_best",
    "load_adapter", "load_best", "load_model", "load_weights", "model_dtype", "read_tracker", "report", "resolve_model_dir",
    "resume", "save", "save_best", "saved_at", "setting_changes", "stopped_line",
]  # fmt: skip


def save(cfg: Any, state: dict[str, Any]) -> Path:
    """Write iter_<step> atomically, point the tracker at it, then rotate old checkpoints; returns it.

    `state` comes from `Trainer.state_dict` (store.py). A full disk is reported as what it is: the
    partial files are removed and the previous checkpoint is untouched.
    """
    try:
        return _save(cfg, state)
    except Exception as exc:  # safetensors reports a full disk as its own error type, not OSError
        if not disk_full(exc):
            raise
        root = Path(cfg.checkpoint.dir)
        shutil.rmtree(tmp_dir(root, state["step"]), ignore_errors=True)
        kept = complete_iters(root)
        raise UserError(
            f"the disk holding {root} is full ({exc}) while writing the checkpoint of step {state['step']}; "
            f"the partial files were removed and the previous checkpoint ({kept[-1].name if kept else 'none yet'}) is "
            "intact. Fix: free space (or lower checkpoint.keep_last, or point checkpoint.dir at a larger disk), then "
            "run the same command again: checkpoint.resume: auto continues from the last complete checkpoint."
        ) from None


def _save(cfg: Any, state: dict[str, Any]) -> Path:
    step, root = state["step"], Path(cfg.checkpoint.dir)
    tmp = write_iteration(cfg, state)  # every rank's files, fsynced below
    final = iter_dir(root, step)
    if distributed.rank() == 0:
        fsync_tree(tmp)
        old = root / f".old_{final.name}"
        if final.exists():  # re-saving a step (e.g. after going back to an earlier iteration)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)
        _write_atomic(root / TRACKER, f"{step}\n")  # the checkpoint exists from here on
        shutil.rmtree(old, ignore_errors=True)
        rotate(root, cfg.checkpoint.keep_last, current=step)
        clean_leftovers(root)
    distributed.barrier()
    return final
