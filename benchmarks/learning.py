"""Does RL help on a user's own task? SFT warm start, then the shipped DAPO / GRPO recipes, per task.

For each task of tests/user_tasks.py (verl parquet + a `user_tasks:exact_boxed` reward, as a user
brings them): `postrl sft` for --sft-steps on correct reference solutions, `postrl doctor` on the
SFT model (greedy vs sampled accuracy, pass@k at the rollout temperature), then 30 steps of
configs/tiny_dapo.yaml and configs/tiny_grpo.yaml with only the data and the reward replaced.
Prints one table row per run: held-out greedy accuracy at the start, best and last (as measured), the
accuracy of the weights the run ends with (the best ones after a checkpoint.back_off at the last
validation), the steps that backed off, and wall time. --all adds the low-headroom tasks.

    python benchmarks/learning.py [--tasks reverse count largest] [--sft-steps 150] [--steps 30] [--out runs/learning]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import user_tasks  # noqa: E402
from rich.console import Console  # noqa: E402

from postrl.checks import load_config  # noqa: E402

REWARD = "reward.verifiers=[user_tasks:exact_boxed]"


def task_overrides(files: dict[str, Path], task: str) -> list[str]:
    return [f"data.train_files=[{files[task + '_train']}]", f"data.val_files=[{files[task + '_val']}]", REWARD]


def sft(files: dict, task: str, out: Path, steps: int) -> tuple[Path, float]:
    from postrl.sft import run_sft

    model = out / "sft" / "model"
    if not (model / "config.json").exists():
        cfg = load_config(ROOT / "configs" / "tiny_sft.yaml", [
            *task_overrides(files, task), f"sft.output_dir={out / 'sft'}", f"sft.steps={steps}",
            f"sft.warmup_steps={min(50, steps // 5)}", f"logging.dir={out / 'sft'}", "logging.progress=false",
        ])  # fmt: skip
        result = run_sft(cfg, Console(file=io.StringIO()))
        (out / "sft" / "result.json").write_text(json.dumps(result))
    result = json.loads((out / "sft" / "result.json").read_text())
    return model, next(v for k, v in result.items() if "acc_mean" in k)


def doctor(files: dict, task: str, model: Path, out: Path) -> dict:
    """`postrl doctor` on the SFT model with the DAPO recipe's sampling (cached in out/sft/doctor.json)."""
    from postrl.doctor import diagnose

    path = out / "sft" / "doctor.json"
    if not path.exists():
        cfg = load_config(ROOT / "configs" / "tiny_dapo.yaml", [*task_overrides(files, task), f"model.path={model}"])
        report = diagnose(cfg, n_prompts=96, log=lambda *a: None)
        report["sampled"] = {str(t): m for t, m in report["sampled"].items()}
        path.write_text(json.dumps(report))
    return json.loads(path.read_text())


def rl(files: dict, task: str, recipe: str, model: Path, out: Path, steps: int, extra: list[str]) -> dict:
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    run = out / Path(recipe).stem
    cfg = load_config(ROOT / "configs" / recipe, [
        *task_overrides(files, task), f"model.path={model}", f"train.total_steps={steps}", f"logging.dir={run}",
        "logging.progress=false", "checkpoint.resume=none", *extra,
    ])  # fmt: skip
    start = time.perf_counter()
    Trainer(cfg, Console(file=io.StringIO())).fit()
    wall = time.perf_counter() - start
    key = next(k for r in read_jsonl(run / "metrics.jsonl") for k in r if k.startswith("val/") and "acc_mean@" in k)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if key in r]
    val = [r[key] for r in rows]
    ends = max(val) if rows[-1].get("training/back_off") else val[-1]  # checkpoint.back_off: the best weights
    backs = [r["step"] for r in rows if r.get("training/back_off")]
    return {"start": val[0], "best": max(val), "last": val[-1], "ends": ends, "back_offs": backs, "wall": wall, "curve": val}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="*", default=list(user_tasks.TASKS))
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--all", action="store_true", help="also the low-headroom tasks (user_tasks.LOW_HEADROOM)")
    ap.add_argument("--recipes", nargs="*", default=["tiny_dapo.yaml", "tiny_grpo.yaml"])
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--tag", default="default", help="name of this setting (a directory under each task)")
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for the RL runs")
    args = ap.parse_args()
    if args.all:
        args.tasks = list(user_tasks.TASKS + user_tasks.LOW_HEADROOM)
    out = Path(args.out)
    files = user_tasks.write(out / "data")
    print("| task | recipe | setting | SFT greedy | start | best | last | ends with | back-offs | wall |", flush=True)
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |", flush=True)
    for task in args.tasks:
        model, sft_acc = sft(files, task, out / task, args.sft_steps)
        doc = doctor(files, task, model, out / task)
        at_t = doc["sampled"][str(doc["temperature"])]
        print(f"doctor {task}: greedy {doc['greedy']:.1%}, T {doc['temperature']} sampled {at_t['acc']:.1%} "
              f"pass@{doc['n']} {at_t['pass@k']:.1%}; {' '.join(doc['advice'])}", flush=True)  # fmt: skip
        for recipe in args.recipes:
            r = rl(files, task, recipe, model, out / task / args.tag, args.steps, args.overrides)
            print(
                f"| {task} | {Path(recipe).stem} | {args.tag} | {sft_acc:.1%} | {r['start']:.1%} | {r['best']:.1%} | "
                f"{r['last']:.1%} | {r['ends']:.1%} | {r['back_offs'] or ''} | {r['wall']:.0f} s |  curve {' '.join(f'{v:.3f}' for v in r['curve'])}",
                flush=True,
            )


if __name__ == "__main__":
    main()
