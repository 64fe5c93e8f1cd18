"""Steps to a held-out greedy accuracy: on-policy distillation vs DAPO, from the same SFT start.

Distillation runs configs/tiny_opd.yaml (teacher: the `make run` DAPO model), RL runs configs/tiny_dapo.yaml,
both from the `make run` SFT model, with the same prompts and samples per step (32 x 8). Each run validates
(greedy, --val-prompts held-out prompts) before the first step and after every step, and stops at the
target or after --max-steps. Prints steps-to-target, the accuracy reached and the wall time, side by side.

    python benchmarks/distill_vs_rl.py [--target 0.40] [--max-steps 20] [--sft runs/tiny_sft/model]
        [--teacher runs/tiny_dapo/checkpoints/best/model] [--out runs/distill_vs_rl] [--only opd] [--run-all]

Needs `make run`'s outputs (or other paths given). On a 2-core CPU a step takes ~10-30 s plus validation.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from postrl.checks import load_config
from postrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def steps_to(recipe: str, overrides: list[str], target: float, max_steps: int, log, run_all: bool = False) -> dict:
    """Train step by step, validating after each, until the held-out greedy accuracy reaches `target`."""
    cfg = load_config(ROOT / "configs" / recipe, [*overrides, "logging.progress=false", "checkpoint.resume=none",
                                                  "checkpoint.save_final=false", "eval.before_train=false"])  # fmt: skip
    tr = Trainer(cfg, Console(file=io.StringIO()))
    start = time.perf_counter()
    curve = []
    try:
        while True:
            val = tr.validate()
            tr.logger.log(tr.step, val)  # <logging.dir>/metrics.jsonl, with the step metrics below
            acc = next(v for k, v in val.items() if k.endswith("acc_mean@1"))
            curve.append(acc)
            log(f"{recipe} step {tr.step}: {acc:.1%}")
            if (acc >= target and not run_all) or tr.step >= max_steps:
                break
            metrics = tr.train_step()
            tr.step += 1
            tr.logger.log(tr.step, metrics)
    finally:
        tr.close()
    reached = next((i for i, a in enumerate(curve) if a >= target), None)
    return {"steps": reached, "curve": curve, "wall_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=float, default=0.40)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--val-prompts", type=int, default=300)
    ap.add_argument("--sft", default="runs/tiny_sft/model")
    ap.add_argument("--teacher", default="runs/tiny_dapo/checkpoints/best/model")
    ap.add_argument("--out", default="runs/distill_vs_rl")
    ap.add_argument("--only", choices=["opd", "dapo"], default=None, help="one side (the table shows both once both ran)")
    ap.add_argument("--run-all", action="store_true", help="train all --max-steps steps, past the target")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for both runs, e.g. distill.top_k=8")
    args = ap.parse_args()
    out = Path(args.out)
    common = [f"model.path={args.sft}", f"eval.max_prompts={args.val_prompts}", f"train.total_steps={args.max_steps}", *args.overrides]
    runs = {
        "distillation (tiny_opd)": ("tiny_opd.yaml", [*common, f"distill.teacher_path={args.teacher}", f"logging.dir={out / 'opd'}"]),
        "DAPO (tiny_dapo)": ("tiny_dapo.yaml", [*(o for o in common if not o.startswith("distill.")), f"logging.dir={out / 'dapo'}"]),
    }
    if args.only:
        runs = {k: v for k, v in runs.items() if v[0] == f"tiny_{args.only}.yaml"}
    out.mkdir(parents=True, exist_ok=True)
    for name, (recipe, ov) in runs.items():
        result = steps_to(recipe, ov, args.target, args.max_steps, print, args.run_all)
        (out / f"result_{Path(recipe).stem}.json").write_text(json.dumps({name: result}, indent=2))
    results = {k: v for f in sorted(out.glob("result_*.json"), reverse=True) for k, v in json.loads(f.read_text()).items()}
    print(f"\nsteps to {args.target:.0%} held-out greedy accuracy ({args.val_prompts} prompts), from {args.sft}:")
    print(f"{'method':<26}{'steps':>7}{'start':>8}{'reached':>9}{'wall s':>8}")
    for name, r in results.items():
        steps = str(r["steps"]) if r["steps"] is not None else f">{len(r['curve']) - 1}"
        print(f"{name:<26}{steps:>7}{r['curve'][0]:>8.1%}{max(r['curve']):>9.1%}{r['wall_s']:>8.0f}")
    print("curves: " + "; ".join(f"{n}: " + " ".join(f"{a:.0%}" for a in r["curve"]) for n, r in results.items()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
