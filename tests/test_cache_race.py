"""Builders racing on a cold cache: several processes build the same built-in task files and the same tiny
model into one empty cache at the same moment; every one succeeds and every published file is whole.

Before each writer had a temporary name of its own, two ranks building the `shapes` task at once shared
`.val.parquet.tmp`: one rank's rename took the other's file (FileNotFoundError), and a torn parquet file
could be published (issue 52). And once torch.distributed is up, transformers writes a model's weights on
rank 0 only: a rank other than 0 that built a tiny model published a directory without config.json or weights,
and a rank loading the model found it gone or half there (the sequence-parallel test on a cold cache).
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
        from postrl.builtin.tasks import task_files
        from postrl.builtin.tiny import build_tiny_model
        from postrl.config.schema import BuiltinTaskConfig, ShapesTaskConfig

        barrier.wait(timeout=120)  # every builder starts on an empty cache at the same moment
        files = {f"arithmetic/{k}": str(v) for k, v in task_files("arithmetic", BuiltinTaskConfig().model_dump()).items()}
        shape_files = task_files("shapes", ShapesTaskConfig().model_dump())
        files.update({f"shapes/{k}": str(v) for k, v in shape_files.items()})
        files["model"] = str(build_tiny_model("tiny-qwen2"))
        results.put(("ok", files))
    except BaseException as exc:  # the test reports what failed in which process
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _build_as_rank(cache: str, rank: int, port: int, results) -> None:
    """Rank `rank` of 2 gloo ranks builds the tiny model, as each rank of a run does: rank 1 on the cold cache."""
    os.environ.update(POSTRL_CACHE=cache, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        from postrl.builtin.tiny import build_tiny_model

        dist.init_process_group("gloo", rank=rank, world_size=2)
        for builder in (1, 0):  # rank 1 first, on the empty cache; then rank 0 finds it published
            if rank == builder:
                path = build_tiny_model("tiny-qwen2")
                files = sorted(p.name for p in path.iterdir())  # what this rank would load now
            dist.barrier()
        results.put(("ok", {"model": str(path), "files": files}))
        dist.destroy_process_group()
    except BaseException as exc:
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


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


@pytest.mark.slow
def test_ranks_of_a_distributed_run_build_the_whole_model_on_a_cold_cache(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_build_as_rank, args=(str(tmp_path / "cache"), r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [status for status, _ in outcomes] == ["ok", "ok"], outcomes
    assert outcomes[0][1] == outcomes[1][1]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(outcomes[0][1]["files"])
    _whole({"model": outcomes[0][1]["model"]})
