"""Async rollout against sync on the `make run` setting, both in one run: e2e tokens/s and the ratio.

The setting is configs/tiny_dapo.yaml as `make run` trains it (the SFT model, 32 prompts x 8 samples,
48 tokens, vLLM rollout, DAPO), with validation and checkpoints off. Each mode trains `--steps` steps
from the same start; the modes take turns (sync, async, sync, async, ...) `--rounds` times, so both
see the same machine load, and the first `--warmup` steps of each run (engine start, compilation,
the worker's first batch) are dropped.

    sync        rollout.placement=colocated: generate, update, sync, in lock-step, all cores for each phase
    async-k     rollout.placement=worker, max_staleness=k: the worker generates step s+1 while the trainer
                updates on step s; the cores are split between the two processes (runtime.threads_for)

e2e tokens/s is the guides' formula (docs/metrics.md) over each step's wall-clock time in the trainer,
waiting for the worker included: (mean response + mean prompt length) x prompts x n / seconds. The
medians over the kept steps of all rounds are printed, with the ratio async / sync.

    python benchmarks/async_vs_sync.py [--model runs/tiny_sft/model] [--steps 8] [--warmup 2] [--rounds 2] [--staleness 1] [--trl]

--trl adds TRL's GRPOTrainer to the rotation as a third peer, on benchmarks/vs_trl.py's setting (64 tokens,
no dynamic sampling or overlong shaping, lr 3e-5, loss dapo; its TRL peer and token count), and the postrl
runs take that setting too. vs_trl.py itself interleaves its peers step by step in one process, which
cannot host a rollout worker that keeps generating between turns; here each peer runs whole.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
import vs_trl  # noqa: E402  (TRL's peer and the shared setting)


def run(mode: str, k: int, args, out: Path) -> list[dict]:
    """One training run of `args.steps` steps; its per-step metrics."""
    from postrl.checks import load_config
    from postrl.trainer import Trainer

    overrides = [
        f"model.path={args.model}", f"train.total_steps={args.steps}", f"logging.dir={out}", "logging.progress=false",
        "eval.before_train=false", "eval.after_train=false", "eval.freq=0", "checkpoint.save_freq=0",
        "checkpoint.save_final=false", f"rollout.placement={'colocated' if mode == 'sync' else 'worker'}", f"rollout.max_staleness={k}",
        f"rollout.engine={args.engine}", *args.override,
    ]  # fmt: skip
    if args.trl:  # vs_trl.py's setting
        overrides += [f"rollout.max_tokens={vs_trl.MAX_TOKENS}", "algorithm.overlong_buffer.enable=false",
                      "algorithm.filter_groups.enable=false", f"train.lr={vs_trl.LR}", "algorithm.kl.coef=0"]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "tiny_dapo.yaml", overrides)
    Trainer(cfg).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "e2e_tps" in r]


def run_trl(args, out: Path) -> list[float]:
    """TRL's GRPOTrainer on the same prompts for warmup + steps steps; e2e tokens/s of each kept step."""
    from postrl.checks import load_config

    recipe = load_config(ROOT / "configs" / "tiny_dapo.yaml", [f"model.path={args.model}"])
    steps: list = []
    trl = vs_trl.trl_trainer(args.model, recipe.train.global_batch_size, args.steps, out,
                             lambda seconds: steps.append(vs_trl.trl_step(acc, seconds)),
                             recipe.data.builtin.model_dump(), recipe.rollout.temperature)  # fmt: skip
    acc = vs_trl.instrument_trl(trl)
    trl.train()
    return [s.tokens / s.seconds for s in steps[args.warmup :]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "runs" / "tiny_sft" / "model"), help="the make-run SFT model (make sft)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--engine", default="vllm")
    p.add_argument("--override", nargs="*", default=[], help="more dotted overrides for both modes")
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (vs_trl.py's setting) in the rotation")
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        print(f"{args.model} has no model: run `make sft` first (or pass --model)", file=sys.stderr)
        return 2
    modes = [("sync", 0), (f"async-{args.staleness}", args.staleness)] + ([("trl", 0)] if args.trl else [])
    tps: dict[str, list[float]] = {name: [] for name, _ in modes}
    idle: dict[str, list[float]] = {name: [] for name, _ in modes}
    phases: dict[str, list[dict]] = {name: [] for name, _ in modes}  # timing/* of each kept step
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, k in modes:
                if name == "trl":
                    got = run_trl(args, Path(tmp) / f"trl-{r}")
                    tps[name] += got
                    idle[name] += [0.0] * len(got)
                else:
                    rows = run(name.split("-")[0], k, args, Path(tmp) / f"{name}-{r}")[args.warmup :]
                    got = [row["e2e_tps"] for row in rows]
                    tps[name] += got
                    idle[name] += [row.get("async/trainer_idle_s", 0.0) for row in rows]
                    phases[name] += [{k[7:]: v for k, v in row.items() if k.startswith("timing/")} for row in rows]
                print(f"round {r + 1} {name:>8}: e2e tokens/s " + " ".join(f"{x:.0f}" for x in got), flush=True)
    print(f"\n{'mode':>8} | median e2e tokens/s | trainer idle s/step")
    for name, _ in modes:
        print(f"{name:>8} | {statistics.median(tps[name]):19.0f} | {statistics.median(idle[name]):.2f}")
    print("\nmedian seconds per step by phase (async: the worker's rollout / reward run beside the trainer's step)")
    for name, _ in modes:
        if phases[name]:
            keys = sorted({k for row in phases[name] for k in row})
            print(f"{name:>8} | " + "  ".join(f"{k} {statistics.median(r.get(k, 0.0) for r in phases[name]):.2f}" for k in keys))
    ratio = statistics.median(tps[modes[1][0]]) / statistics.median(tps["sync"])
    print(f"\nasync (max_staleness {args.staleness}) / sync: {ratio:.2f}x  (cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f})")
    if args.trl:
        for name, _ in modes[:2]:
            print(f"{name} / TRL: {statistics.median(tps[name]) / statistics.median(tps['trl']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
