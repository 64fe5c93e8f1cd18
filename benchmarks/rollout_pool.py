"""The rollout pool (rollout.placement: pool) against the local worker, all in one run: e2e tokens/s and ratios.

    worker      rollout.placement=worker: one worker process beside the trainer, the cores split between
                them (runtime.threads_for; each lends its threads to the other while it waits)
    pool-1      one Ray replica holding --replica-cores cores (the same as the worker's share): the
                service's overhead (actor calls, chunk dealing, weights by a gloo broadcast)
    pool-1xR    one replica holding 2 x --replica-cores cores
    pool-2      two replicas of --replica-cores each: the same total rollout cores as pool-1xR (the dealing)

Each mode trains --steps steps from the same start, max_staleness --staleness; the modes take turns
--rounds times (so they see the same machine load) and the first --warmup steps of each run (engine and
replica start, the first batch) are dropped. e2e tokens/s is the guides' formula over each step's wall
time in the trainer, waiting for rollout included. One Ray instance (this machine) serves every pool run.

    python benchmarks/rollout_pool.py [--model builtin:tiny-qwen2] [--engine hf] [--steps 8] [--warmup 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]


def run(name: str, extra: list[str], args, out: Path) -> list[dict]:
    from postrl.checks import load_config
    from postrl.trainer import Trainer

    overrides = [
        f"model.path={args.model}", f"rollout.engine={args.engine}", f"train.total_steps={args.steps}", f"logging.dir={out}",
        "logging.progress=false", "eval.before_train=false", "eval.after_train=false", "eval.freq=0", "checkpoint.save_freq=0",
        "checkpoint.save_final=false", f"rollout.max_staleness={args.staleness}", "data.train_files=[builtin:arithmetic:train]",
        "data.val_files=[builtin:arithmetic:val]", f"rollout.n_samples_per_prompt={args.n}", f"rollout.max_tokens={args.max_tokens}",
        f"train.global_batch_size={args.prompts}", f"train.gen_batch_size={args.prompts}", "train.micro_batch_size=64",
        "algorithm.filter_groups.enable=false", *extra, *args.override,
    ]  # fmt: skip
    Trainer(load_config(None, overrides)).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "e2e_tps" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-qwen2")
    p.add_argument("--engine", default="hf")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--replica-cores", type=int, default=1)
    p.add_argument("--override", nargs="*", default=[])
    args = p.parse_args()
    import ray

    c = args.replica_cores
    ray.init(num_cpus=max(os.cpu_count() or 1, 2 * c), include_dashboard=False, log_to_driver=False)
    pool = ["rollout.placement=pool"]
    modes = {
        "worker": ["rollout.placement=worker"],
        "pool-1": [*pool, "rollout.pool.replicas=1", f"rollout.pool.cpus_per_replica={c}"],
        f"pool-1x{2 * c}": [*pool, "rollout.pool.replicas=1", f"rollout.pool.cpus_per_replica={2 * c}"],
        "pool-2": [*pool, "rollout.pool.replicas=2", f"rollout.pool.cpus_per_replica={c}"],
    }
    tps: dict[str, list[float]] = {m: [] for m in modes}
    phases: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, extra in modes.items():
                rows = run(name, extra, args, Path(tmp) / f"{name}-{r}")[args.warmup :]
                tps[name] += [row["e2e_tps"] for row in rows]
                phases[name] += [{k: v for k, v in row.items() if k.startswith(("timing/", "rollout_pool/", "async/trainer_idle"))} for row in rows]
                print(f"round {r + 1} {name:>9}: e2e tokens/s " + " ".join(f"{row['e2e_tps']:.0f}" for row in rows), flush=True)
    med = {m: statistics.median(v) for m, v in tps.items()}
    print(f"\n{'mode':>9} | median e2e tokens/s | median seconds per step by phase")
    for m in modes:
        keys = ["timing/all", "timing/rollout", "timing/update", "timing/wait_rollout", "rollout_pool/publish_s",
                "rollout_pool/idle_share", "rollout_pool/version_lag"]  # fmt: skip
        got = "  ".join(f"{k.split('/')[-1]} {statistics.median(r.get(k, 0.0) for r in phases[m]):.2f}" for k in keys
                        if any(k in r for r in phases[m]))  # fmt: skip
        print(f"{m:>9} | {med[m]:19.0f} | {got}")
    wide = f"pool-1x{2 * c}"
    print(f"\npool-1 / worker (same cores): {med['pool-1'] / med['worker']:.2f}x")
    print(f"pool-2 / {wide} (same total rollout cores): {med['pool-2'] / med[wide]:.2f}x")
    print(f"pool-2 / pool-1: {med['pool-2'] / med['pool-1']:.2f}x  (cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f})")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
