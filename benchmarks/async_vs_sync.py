"""Async rollout against sync on the `make run` setting, both in one run: e2e tokens/s and the ratio.

The setting is configs/tiny_dapo.yaml as `make run` trains it (the SFT model, 32 prompts x 8 samples,
48 tokens, vLLM rollout, DAPO), with validation and checkpoints off. Each mode trains `--steps` steps
from the same start; the modes take turns (sync, async, sync, async, ...) `--rounds` times, so both
see the same machine load, and the first `--warmup` steps of each run (engine start, compilation,
the worker's first batch) are dropped.

    sync        rollout.mode=sync: generate, update, sync, in lock-step, all cores for each phase
    async-k     rollout.mode=async, max_staleness=k: the worker generates step s+1 while the trainer
                updates on step s; the cores are split between the two processes (runtime.threads_for)

e2e tokens/s is the guides' formula (docs/metrics.md) over each step's wall-clock time in the trainer,
waiting for the worker included: (mean response + mean prompt length) x prompts x n / seconds. The
medians over the kept steps of all rounds are printed, with the ratio async / sync.

    python benchmarks/async_vs_sync.py [--model runs/tiny_sft/model] [--steps 8] [--warmup 2] [--rounds 2] [--staleness 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, k: int, args, out: Path) -> list[dict]:
    """One training run of `args.steps` steps; its per-step metrics."""
    from postrl.config import load_config
    from postrl.trainer import Trainer

    overrides = [
        f"model.path={args.model}", f"train.total_steps={args.steps}", f"logging.dir={out}", "logging.progress=false",
        "eval.before_train=false", "eval.after_train=false", "eval.freq=0", "checkpoint.save_freq=0",
        "checkpoint.save_final=false", f"rollout.mode={mode}", f"rollout.max_staleness={k}",
        f"rollout.engine={args.engine}", *args.override,
    ]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "tiny_dapo.yaml", overrides)
    Trainer(cfg).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "e2e_tps" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "runs" / "tiny_sft" / "model"), help="the make-run SFT model (make sft)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--engine", default="vllm")
    p.add_argument("--override", nargs="*", default=[], help="more dotted overrides for both modes")
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        print(f"{args.model} has no model: run `make sft` first (or pass --model)", file=sys.stderr)
        return 2
    modes = [("sync", 0), (f"async-{args.staleness}", args.staleness)]
    tps: dict[str, list[float]] = {name: [] for name, _ in modes}
    idle: dict[str, list[float]] = {name: [] for name, _ in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, k in modes:
                rows = run(name.split("-")[0], k, args, Path(tmp) / f"{name}-{r}")[args.warmup :]
                tps[name] += [row["e2e_tps"] for row in rows]
                idle[name] += [row.get("async/trainer_idle_s", 0.0) for row in rows]
                print(f"round {r + 1} {name:>8}: e2e tokens/s " + " ".join(f"{x:.0f}" for x in tps[name][-len(rows):]), flush=True)
    print(f"\n{'mode':>8} | median e2e tokens/s | trainer idle s/step")
    for name, _ in modes:
        print(f"{name:>8} | {statistics.median(tps[name]):19.0f} | {statistics.median(idle[name]):.2f}")
    ratio = statistics.median(tps[modes[1][0]]) / statistics.median(tps["sync"])
    print(f"\nasync (max_staleness {args.staleness}) / sync: {ratio:.2f}x  (cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
