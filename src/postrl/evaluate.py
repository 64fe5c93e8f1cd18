"""`postrl eval`: accuracy of a model or checkpoint on the validation files of a config.

Uses the same code path as the trainer's validation (`trainer.evaluate`), so a checkpoint evaluated
here reports the accuracy the trainer logged for it: greedy acc_mean@1 with eval.temperature 0, or
mean@n / pass@n with eval.n_samples > 1 and a temperature.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from postrl.checkpoint import TRACKER, iter_dir
from postrl.errors import UserError


def resolve_model_dir(path: str) -> str:
    """A model directory, a checkpoint (iter_*) or a checkpoint root (with the tracker file)."""
    p = Path(path)
    if (p / TRACKER).exists():
        p = iter_dir(p, int((p / TRACKER).read_text().strip()))
    if (p / "model" / "config.json").exists():
        p = p / "model"
    if not (p / "config.json").exists() and not str(path).startswith("builtin:"):
        raise UserError(f"'{path}' is not a model directory or postrl checkpoint (no config.json). Fix: pass one.")
    return str(p)


def run_eval(args: Any, console: Any) -> int:
    from postrl.config import load_config
    from postrl.data.dataset import load_prompts
    from postrl.models import load_policy
    from postrl.rewards import RewardFunction
    from postrl.rollout import make_engine
    from postrl.trainer import evaluate

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={resolve_model_dir(args.model)}")
    cfg = load_config(args.config, overrides)
    if cfg.model.path and not cfg.model.path.startswith("builtin:"):
        cfg.model.path = resolve_model_dir(cfg.model.path)
    model, tokenizer, path = load_policy(cfg.model)
    model.eval()
    engine = make_engine(cfg.rollout, model, tokenizer, log=console.print)
    reward_fn = RewardFunction(cfg.reward)
    results: dict[str, float] = {}
    for f in cfg.eval.files or []:
        examples, _ = load_prompts([f], tokenizer, cfg.data, max_rows=cfg.eval.max_prompts)
        name = examples[0].data_source if f.startswith("builtin:") else Path(f).stem
        results.update(evaluate(engine, tokenizer, reward_fn, examples, cfg.eval, name, cfg.train.seed))
    reward_fn.close()
    console.print(f"model: {path}")
    for k, v in results.items():
        console.print(f"  {k:<45} {v:.4f}")
    console.print(json.dumps(results), markup=False, highlight=False)
    return 0
