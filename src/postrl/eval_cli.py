"""`postrl eval CONFIG|CHECKPOINT [--model DIR]`: a model's held-out accuracy on the eval files, with the run's
engine and verifiers (evaluate.py measures; assembly.py builds the eval role)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from postrl.errors import UserError
from postrl.agents.verifiers.env import dataset_rows
from postrl.evaluate import evaluate, load_val_sets


def evaluate_model(cfg, log: Any = None) -> tuple[dict[str, float], str]:
    """Load model.path (model directory or checkpoint) and evaluate it on every eval file."""
    from postrl.assembly import build_run

    if not cfg.model.path.startswith("builtin:") and not cfg.model.path.endswith(".gguf"):  # (a GGUF: models.py)
        cfg.model.path = str(_resolve(cfg.model.path))
    run = build_run(cfg, "eval", log)  # weights in model.dtype: nothing trains here (runtime.py: precision)
    policy, agent = run.policy, cfg.rollout.takes_rows
    results: dict[str, float] = {}
    try:
        val_sets = load_val_sets(cfg.eval.files or [], policy.tokenizer, cfg.data, cfg.eval.max_prompts, policy.modality, run.tools, dataset_rows)
        for name, examples in val_sets.items():
            results.update(evaluate(run.engine, policy.tokenizer, run.reward_fn, examples, cfg.eval, name, cfg.train.seed, agent))
    finally:
        run.close()
    return results, policy.path


def _resolve(path: str) -> Path:
    from postrl.checkpoint import resolve_model_dir

    return resolve_model_dir(path)


def _checkpoint_config(path: Path) -> tuple[Path, Path] | None:
    """(config.yaml, model dir) when `path` is a checkpoint (iter_* or a root with the tracker file)."""
    from postrl.checkpoint import TRACKER, iter_dir, read_tracker

    if (path / TRACKER).exists():
        path = iter_dir(path, read_tracker(path))
    if (path / "config.yaml").is_file() and (path / "model" / "config.json").is_file():
        return path / "config.yaml", path / "model"
    return None


def run_eval(args: Any, console: Any) -> int:
    from postrl.checks import load_config

    overrides = list(args.overrides)
    config = Path(args.config)
    if config.is_dir():
        found = _checkpoint_config(config)
        if found is None:
            raise UserError(
                f"'{args.config}' is a directory but not a postrl checkpoint (no config.yaml and model/). "
                "Fix: pass a YAML config (with --model for the weights), or a checkpoint directory."
            )
        config, model_dir = found
        overrides.insert(0, f"model.path={model_dir}")
        overrides.insert(1, "model.tokenizer_path=null")
    if args.model:
        overrides.append(f"model.path={_resolve(args.model)}")
        overrides.append("model.tokenizer_path=null")
    cfg = load_config(config, overrides)
    results, path = evaluate_model(cfg, log=console.print)
    console.print(f"model: {path}")
    for k, v in results.items():
        console.print(f"  {k:<45} {v:.4f}", markup=False, highlight=False)
    console.print(json.dumps(results), markup=False, highlight=False, soft_wrap=True)
    return 0
