"""Full training comparison: the same GRPO config with rollout.engine=hf and rollout.engine=vllm.

Each engine trains in its own subprocess (vLLM changes process-wide state), one after the other in
this one run, so both see the same machine. Prints the mean e2e_tps / update_tps / rollout tps of
the steps after the first (warm-up) and the vLLM / HF ratio.

    .venv/bin/python benchmarks/train_engines.py [--steps 6] [--model builtin:tiny-qwen2] [override ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("e2e_tps", "update_tps", "rollout_tps", "timing/all", "timing/rollout", "timing/update")


def run(engine: str, steps: int, model: str, extra: list[str], workdir: Path) -> dict[str, float]:
    log_dir = workdir / engine
    cmd = [
        sys.executable, "-m", "postrl.cli", "train", str(ROOT / "configs" / "tiny_grpo.yaml"),
        f"model.path={model}", f"rollout.engine={engine}", f"train.total_steps={steps}",
        "eval.before_train=false", "eval.after_train=false", "checkpoint.save_final=false",
        "logging.progress=false", f"logging.dir={log_dir}", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "e2e_tps" in r][1:]  # drop the warm-up step
    return {k: sum(r[k] for r in steps_rows) / len(steps_rows) for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="builtin:tiny-qwen2")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {engine: run(engine, args.steps, args.model, args.overrides, Path(tmp)) for engine in ("hf", "vllm")}
    print(f"\n{'metric':<16}{'hf':>12}{'vllm':>12}{'vllm/hf':>10}")
    for k in KEYS:
        hf, vl = results["hf"][k], results["vllm"][k]
        print(f"{k:<16}{hf:>12.1f}{vl:>12.1f}{vl / hf if hf else float('nan'):>10.2f}")


if __name__ == "__main__":
    main()
