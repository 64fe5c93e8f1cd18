"""The best weights of a run (`checkpoint.keep_best`): <checkpoint.dir>/best, replaced whenever the
headline validation metric beats the kept one.

    <checkpoint.dir>/best/
      model/          Hugging Face format (merged, with LoRA), what `postrl export` copies
      best.json       {"step", "metric", "value"}
      config.yaml     the run's config (export reads its model.dtype)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from postrl import distributed
from postrl.checkpoint.files import fsync_dir, fsync_tree, remove
from postrl.checkpoint.restore import load_weights
from postrl.checkpoint.store import save_weights

BEST = "best"


def best_so_far(cfg: Any) -> dict | None:
    """{"step", "metric", "value"} of the weights in <checkpoint.dir>/best, or None."""
    info = Path(cfg.checkpoint.dir) / BEST / "best.json"
    return json.loads(info.read_text()) if info.is_file() else None


def best_dir(cfg: Any) -> Path | None:
    """<checkpoint.dir>/best where checkpoint.keep_best is set, else None."""
    return Path(cfg.checkpoint.dir) / BEST if cfg.checkpoint.keep_best else None


def load_best(cfg: Any, model: Any) -> None:
    """The kept best weights back into `model` (checkpoint.back_off / end_with_best)."""
    load_weights(model, Path(cfg.checkpoint.dir) / BEST / "model")


def save_best(cfg: Any, model: Any, tokenizer: Any, step: int, value: float, metric: str) -> Path:
    """Replace <checkpoint.dir>/best with these weights (a Hugging Face model dir in best/model) and the
    run's config.yaml beside them (export reads its model.dtype)."""
    from postrl.config import dump_config

    root = Path(cfg.checkpoint.dir)
    final, tmp = root / BEST, root / f".tmp_{BEST}"
    write = distributed.rank() == 0
    if write:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    save_weights(cfg, model, tokenizer, tmp, write)
    if write:
        (tmp / "best.json").write_text(json.dumps({"step": step, "metric": metric, "value": value}))
        (tmp / "config.yaml").write_text(dump_config(cfg))
        fsync_tree(tmp)
        remove(final)
        os.replace(tmp, final)
        fsync_dir(root)
    distributed.barrier()
    return final


def keep_if_best(cfg: Any, model: Any, tokenizer: Any, step: int, found: tuple[str, float] | None) -> None:
    """Save these weights as the best when `found` (the headline metric's name and value of this
    validation) beats the kept one; a no-op without checkpoint.keep_best."""
    if found is None or not cfg.checkpoint.keep_best:
        return
    name, value = found
    best = best_so_far(cfg)
    if best is None or best.get("metric") != name or value > best["value"]:
        save_best(cfg, model, tokenizer, step, value, name)


def fell_below_best(cfg: Any, found: tuple[str, float] | None, last: bool = False, collapsed: bool = False) -> dict | None:
    """The kept best {"step", "metric", "value"} when this validation (`found`) is more than the allowed
    fall below it: checkpoint.back_off during the run, checkpoint.end_with_best (else back_off) at the
    `last` validation; else None (also when neither is set, or without keep_best). `collapsed` (the
    heldout_collapse guard held) makes any fall enough where back_off is on."""
    c = cfg.checkpoint
    allowed = (c.end_with_best if c.end_with_best is not None else c.back_off) if last else c.back_off
    if collapsed and c.back_off is not None:
        allowed = 0.0
    if found is None or allowed is None or not c.keep_best:
        return None
    best = best_so_far(cfg)
    if best is None or best.get("metric") != found[0] or best["value"] - found[1] <= allowed + 1e-9:
        return None
    return best


def back_off_line(best: dict, value: float, step: int, lr: float | None) -> str:
    """What a back-off says: end_with_best at the end (`lr` None), else back-off with the new peak lr."""
    fell = f"{best['metric']} fell to {value:.1%} at step {step}, {best['value'] - value:.1%} below the best {best['value']:.1%}"
    if lr is None:
        return f"[yellow]end_with_best: {fell}; the run ends with step {best['step']}'s weights.[/yellow]"
    return f"[yellow]back-off: {fell}: the weights are step {best['step']}'s again, the peak lr {lr:.2g} from here.[/yellow]"
