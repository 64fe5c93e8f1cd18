"""Host memory of a long tiny run with glibc malloc vs jemalloc (LD_PRELOAD), as docs/distributed.md reports.

    python benchmarks/jemalloc_rss.py --steps 80 [--jemalloc /usr/lib/x86_64-linux-gnu/libjemalloc.so.2]

Runs `postrl train configs/tiny_dapo.yaml` (the random-init tiny model, HF rollout) twice, once with
and once without LD_PRELOAD, and samples the resident memory of the trainer and its verifier workers
(the whole process tree) every 0.5 s. Prints the peak and the mean RSS over the first and last fifth
of each run: the growth between them is what fragmentation adds over a long run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import psutil

TINY = [
    "model.path=builtin:tiny-qwen2", "rollout.engine=hf", "rollout.n_samples_per_prompt=4", "rollout.max_tokens=24",
    "data.builtin.train_size=400", "train.global_batch_size=8", "train.micro_batch_size=8", "eval.before_train=false",
    "eval.after_train=false", "logging.progress=false", "checkpoint.save_final=false", "algorithm.filter_groups.enable=false",
]  # fmt: skip


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run(steps: int, preload: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "postrl.cli", "train", "configs/tiny_dapo.yaml", *TINY,
               f"train.total_steps={steps}", f"logging.dir={d}/run"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ps, samples, t0 = psutil.Process(proc.pid), [], time.monotonic()
        while proc.poll() is None:
            samples.append(tree_rss(ps))
            time.sleep(0.5)
        assert proc.returncode == 0, f"the run failed ({proc.returncode})"
    k = max(1, len(samples) // 5)
    mib = 1 << 20
    return {
        "seconds": time.monotonic() - t0, "peak_mib": max(samples) / mib,
        "first_fifth_mib": sum(samples[:k]) / k / mib, "last_fifth_mib": sum(samples[-k:]) / k / mib,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--jemalloc", default="/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    args = ap.parse_args()
    for name, preload in (("glibc malloc", None), ("jemalloc", args.jemalloc)):
        r = run(args.steps, preload)
        print(f"{name:>12}: {args.steps} steps in {r['seconds']:.0f} s; RSS peak {r['peak_mib']:.0f} MiB, "
              f"first fifth {r['first_fifth_mib']:.0f} MiB, last fifth {r['last_fifth_mib']:.0f} MiB "
              f"(growth {r['last_fifth_mib'] - r['first_fifth_mib']:+.0f} MiB)")  # fmt: skip


if __name__ == "__main__":
    main()
