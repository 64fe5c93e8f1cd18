"""Checkpoints: save, exact resume and export (DESIGN.md section 6).

    <checkpoint.dir>/
      latest_checkpointed_iteration.txt      "N"; edit it to resume from another iteration
      iter_0000010/
        model/                               Hugging Face format (config, safetensors, tokenizer)
        optimizer/rank{r}.pt  scheduler.pt  rng_rank{r}.pt  dataloader.pt  trainer_state.json  config.yaml

A checkpoint is written to a temporary directory, renamed into place, and only then named in the
tracker file (itself replaced atomically), so a crash at any moment leaves the previous checkpoint
as the one `resume: auto` picks up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from postrl.errors import UserError

if TYPE_CHECKING:
    from postrl.trainer import Trainer

TRACKER = "latest_checkpointed_iteration.txt"
BATCH_KEYS = ("global_batch_size", "gen_batch_size", "mini_batch_size", "n_samples_per_prompt", "epochs_per_batch")


def iter_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def _batch_settings(cfg) -> dict:
    t = cfg.train
    return {
        "global_batch_size": t.global_batch_size,
        "gen_batch_size": t.gen_batch_size,
        "mini_batch_size": t.mini_batch_size,
        "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "epochs_per_batch": t.epochs_per_batch,
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(trainer: "Trainer", rank: int = 0) -> Path:
    """Write iter_<step> atomically and point the tracker at it; rotate old checkpoints."""
    from postrl.config import dump_config

    cfg = trainer.cfg
    root = Path(cfg.checkpoint.dir)
    root.mkdir(parents=True, exist_ok=True)
    final = iter_dir(root, trainer.step)
    tmp = root / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "optimizer").mkdir(parents=True)
    trainer.model.save_pretrained(tmp / "model", safe_serialization=True)
    trainer.tokenizer.save_pretrained(tmp / "model")
    torch.save(trainer.optimizer.state_dict(), tmp / "optimizer" / f"rank{rank}.pt")
    torch.save(trainer.scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    torch.save({"sampler": trainer.sampler.state_dict()}, tmp / "dataloader.pt")
    state = {"step": trainer.step, "algorithm": cfg.algorithm.name, "batch": _batch_settings(cfg), "world_size": cfg.world_size}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    (tmp / "config.yaml").write_text(dump_config(cfg))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():  # re-saving the same step: the tracker may name it, so move it aside first
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / TRACKER, f"{trainer.step}\n")
    _rotate(root, cfg.checkpoint.keep_last, keep=final)
    return final


def _rotate(root: Path, keep_last: int, keep: Path) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in root.glob("iter_*") if p.is_dir())
    for old in done[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def find_resume_dir(cfg) -> Path | None:
    """The checkpoint `checkpoint.resume` points at, or None for a fresh start."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    root = Path(cfg.checkpoint.dir) if resume == "auto" else Path(resume)
    if resume != "auto" and (root / "trainer_state.json").exists():
        return root
    tracker = root / TRACKER
    if not tracker.exists():
        if resume == "auto":
            return None
        raise UserError(
            f"checkpoint.resume: '{resume}' is neither a checkpoint (iter_* with trainer_state.json) nor a "
            f"checkpoint directory with {TRACKER}. Fix: point it at one, or use 'auto' / 'none'."
        )
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise UserError(f"{tracker} holds '{text}', not an iteration number. Fix: write the step of an existing iter_* directory into it.")
    path = iter_dir(root, int(text))
    if not (path / "trainer_state.json").exists():
        raise UserError(
            f"{tracker} names iteration {text}, but {path} is not a complete checkpoint. "
            f"Fix: write the number of an existing checkpoint into {tracker} (found: "
            f"{', '.join(p.name for p in sorted(root.glob('iter_*'))) or 'none'})."
        )
    return path


def load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings are not saved
    assert not missing and not unexpected, f"checkpoint weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"


def maybe_resume(trainer: "Trainer", rank: int = 0) -> Path | None:
    """Restore the trainer from the checkpoint named by `checkpoint.resume`; returns its path."""
    cfg = trainer.cfg
    path = find_resume_dir(cfg)
    if path is None:
        return None
    load_weights(trainer.model, path / "model")
    if cfg.checkpoint.finetune:
        return path
    state = json.loads((path / "trainer_state.json").read_text())
    changed = {k: (state["batch"].get(k), v) for k, v in _batch_settings(cfg).items() if state["batch"].get(k) != v}
    if changed:
        trainer.log(
            "[yellow]warning: batch settings differ from the checkpoint's "
            + ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
            + "; the resumed run will not match an uninterrupted one (data order and step size change).[/yellow]"
        )
    trainer.step = state["step"]
    if cfg.checkpoint.load_optimizer:
        opt = path / "optimizer" / f"rank{rank}.pt"
        trainer.optimizer.load_state_dict(torch.load(opt, weights_only=False))
        trainer.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    else:
        for _ in range(trainer.step):
            trainer.scheduler.step()
    if cfg.checkpoint.load_rng and (path / f"rng_rank{rank}.pt").exists():
        set_rng_state(torch.load(path / f"rng_rank{rank}.pt", weights_only=False))
    trainer.sampler.load_state_dict(torch.load(path / "dataloader.pt", weights_only=False)["sampler"])
    return path


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Copy a checkpoint's model/ (or a checkpoint dir's latest) to a plain HF model directory."""
    src = Path(checkpoint)
    if (src / TRACKER).exists():
        src = iter_dir(src, int((src / TRACKER).read_text().strip()))
    if (src / "model" / "config.json").exists():
        src = src / "model"
    if not (src / "config.json").exists():
        raise UserError(
            f"'{checkpoint}' is not a postrl checkpoint (no model/config.json). Fix: pass a checkpoint "
            f"directory (with {TRACKER}) or one of its iter_* directories."
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"export target '{out}' exists and is not empty. Fix: choose a new directory.")
    shutil.copytree(src, out, dirs_exist_ok=True)
    return out
