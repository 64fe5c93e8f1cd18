"""Builders racing on a cold cache: several processes build the same built-in task files and the same tiny
model into one empty cache at the same moment; every one succeeds and every published file is whole.

Before each writer had a temporary name of its own, two ranks building the `shapes` task at once shared
`.val.parquet.tmp`: one rank's rename took the other's file (FileNotFoundError), and a torn parquet file
could be published (issue 52).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

WORKERS = 3
ROUNDS = 2


def _build(cache: str, barrier, results) -> None:
    os.environ["POSTRL_CACHE"] = cache
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        from postrl.builtin import arithmetic, shapes
        from postrl.builtin.tiny import build_tiny_model
        from postrl.config.schema import BuiltinTaskConfig, ShapesTaskConfig

        barrier.wait(timeout=120)  # every builder starts on an empty cache at the same moment
        files = {f"arithmetic/{k}": str(v) for k, v in arithmetic.task_files(BuiltinTaskConfig().model_dump()).items()}
        shape_files = shapes.task_files(ShapesTaskConfig().model_dump())
        files.update({f"shapes/{k}": str(v) for k, v in shape_files.items()})
        files["model"] = str(build_tiny_model("tiny-qwen2"))
        results.put(("ok", files))
    except BaseException as exc:  # the test reports what failed in which process
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _whole(files: dict[str, str]) -> dict[str, int]:
    """Rows per task file, read back in full, and the model loaded (a torn file raises)."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = {k: pq.read_table(v).num_rows for k, v in files.items() if k != "model"}
    AutoModelForCausalLM.from_pretrained(files["model"])
    tok = AutoTokenizer.from_pretrained(files["model"])
    assert tok.eos_token == "<|im_end|>"
    return rows


@pytest.mark.slow
def test_concurrent_builders_of_one_cold_cache_all_succeed(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    for round_ in range(ROUNDS):
        cache = tmp_path / f"cache{round_}"
        barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
        procs = [ctx.Process(target=_build, args=(str(cache), barrier, results)) for _ in range(WORKERS)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        errors = [msg for status, msg in outcomes if status != "ok"]
        assert not errors, f"round {round_}: {len(errors)} of {WORKERS} builders failed: {errors}"
        published = {frozenset(files.items()) for _, files in outcomes}
        assert len(published) == 1, "every builder must end with the same published paths"
        rows = _whole(outcomes[0][1])
        assert all(n > 0 for n in rows.values()), rows
        leftovers = [p for p in cache.rglob("*.tmp")]
        assert not leftovers, f"scratch files left behind: {leftovers}"
