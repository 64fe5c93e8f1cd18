"""Verifier throughput on a realistic mix that includes pathological completions.

    .venv/bin/python benchmarks/verifier_throughput.py [--n 2000] [--pathological 20] [--timeout 5] [--workers 2]

The mix (deterministic for a seed) draws from the real MATH-500 and GSM8K files in ../shared/data:
reference solutions against their own and another row's answer, reformatted equivalent answers
(`0.5` for `\\frac{1}{2}`, `\\dfrac`), GSM8K solutions, and `--pathological` adversarial completions
(`\\boxed{9^{9^{9^{9}}}}`, a 1 MB completion, deeply nested braces, a 200k-term sum, ...). Every
verification runs through `RewardFunction` exactly as in training (fast path, then the time-limited
worker pool). Prints verifications per second, the count of time-outs and the slowest batch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"

PATHOLOGICAL = [
    ("\\boxed{9^{9^{9^{9}}}}", "5"),
    ("x" * 1_000_000 + " \\boxed{7}", "7"),
    ("y" * 1_000_000, "7"),
    ("\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "1"),
    ("\\boxed{" + "+".join(["x"] * 200_000) + "}", "200000x"),
    ("\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}", "1"),
    ("\\boxed{10^{10^{10^{10}}} - 10^{10^{10^{10}}}}", "0"),
    ("\\boxed{\\frac{" + "9" * 5000 + "}{" + "7" * 5000 + "}}", "\\frac{1}{2}"),
    ("\\boxed{\\sqrt{" * 500 + "2" + "}}" * 500, "2"),
    ("\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "4"),
]


def build_cases(n: int, n_pathological: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (completion, ground truth) pairs, n_pathological of them adversarial, shuffled."""
    rng = random.Random(seed)
    math_rows = [json.loads(x) for x in (DATA / "math500_test.jsonl").read_text().splitlines()]
    gsm_rows = [json.loads(x) for x in (DATA / "gsm8k_test.jsonl").read_text().splitlines()]
    cases: list[tuple[str, str]] = []
    while len(cases) < n - n_pathological:
        kind = rng.random()
        if kind < 0.35:
            r = rng.choice(math_rows)
            cases.append((r["solution"], r["answer"]))
        elif kind < 0.6:
            r, other = rng.choice(math_rows), rng.choice(math_rows)
            cases.append((r["solution"], other["answer"]))
        elif kind < 0.8:
            a, b = rng.randint(1, 20), rng.randint(2, 20)
            forms = [f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", f"{a}/{b}", f"{a / b:.6g}"]
            cases.append((f"So the answer is \\boxed{{{rng.choice(forms)}}}.", rng.choice(forms)))
        else:
            r = rng.choice(gsm_rows)
            number = r["answer"].rsplit("####", 1)[1].strip().replace(",", "")
            cases.append((r["answer"].replace("####", "The answer is \\boxed{") + "}", number))
    for k in range(n_pathological):
        cases.append(PATHOLOGICAL[k % len(PATHOLOGICAL)])
    rng.shuffle(cases)
    return cases


def run(n: int = 2000, n_pathological: int = 20, timeout_s: float = 5.0, workers: int = 2, batch: int = 256,
        verifier: str = "math_17k_acc", seed: int = 0) -> dict:
    from postrl.config import RewardConfig
    from postrl.rewards import RewardFunction

    cases = build_cases(n, n_pathological, seed)
    rf = RewardFunction(RewardConfig(verifiers=[{"name": verifier}], timeout_s=timeout_s, workers=workers))
    t0 = time.perf_counter()
    timeouts = errors = 0
    slowest = 0.0
    mean_score = 0.0
    try:
        rf([r"\boxed{1}"], ["1"], [{}])  # nothing to start: the fast path decides
        for b in range(0, len(cases), batch):
            chunk = cases[b : b + batch]
            tb = time.perf_counter()
            out = rf([c for c, _ in chunk], [g for _, g in chunk], [{}] * len(chunk))
            slowest = max(slowest, time.perf_counter() - tb)
            timeouts += out.timeouts
            errors += out.errors
            mean_score += sum(out.scores)
    finally:
        rf.close()
    elapsed = time.perf_counter() - t0
    return {
        "verifications": len(cases),
        "pathological": n_pathological,
        "seconds": elapsed,
        "per_second": len(cases) / elapsed,
        "timeouts": timeouts,
        "errors": errors,
        "mean_score": mean_score / len(cases),
        "slowest_batch_s": slowest,
        "timeout_s": timeout_s,
        "workers": workers,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--pathological", type=int, default=20)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--verifier", default="math_17k_acc")
    args = p.parse_args(argv)
    if not (DATA / "math500_test.jsonl").exists():
        print(f"needs {DATA}/math500_test.jsonl and gsm8k_test.jsonl", file=sys.stderr)
        return 1
    s = run(args.n, args.pathological, args.timeout, args.workers, verifier=args.verifier)
    print(
        f"{s['verifications']} verifications ({s['pathological']} pathological) with {s['workers']} workers, "
        f"time limit {s['timeout_s']:g} s: {s['seconds']:.1f} s = {s['per_second']:.1f} verifications/s; "
        f"timeouts {s['timeouts']}, errors {s['errors']}, mean score {s['mean_score']:.3f}, "
        f"slowest batch {s['slowest_batch_s']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
