"""The guides' distributed knobs on 2 gloo ranks: cluster.collective_timeout_s, train.reshard_after_forward."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Block(torch.nn.Linear):
    pass


class TwoBlocks(torch.nn.Module):
    _no_split_modules = ["Block"]  # one FSDP unit per block, as a transformer's layers

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(8, 8), Block(8, 8)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _worker(rank: int, out_dir: str) -> None:
    from torch.distributed.tensor import DTensor

    from postrl import distributed

    out = Path(out_dir)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
    os.environ[distributed.RENDEZVOUS_FILE_ENV] = str(out / "store")
    assert distributed.init_process_group(timeout_s=4.0)
    result = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        model = distributed.wrap_model(TwoBlocks(), "fsdp2", reshard_after_forward=reshard)
        model(torch.ones(2, 8)).sum()  # forward only: what stays gathered until the backward
        result[str(reshard)] = isinstance(model.blocks[0].weight, DTensor)
    torch.distributed.barrier()
    if rank == 0:  # rank 1 never joins this barrier: it must fail after the group's timeout, not hang for 30 min
        start = time.monotonic()
        try:
            torch.distributed.barrier()
            result["barrier"] = "returned"
        except Exception as exc:  # noqa: BLE001 - gloo reports the timeout as a RuntimeError
            result["barrier"] = f"{type(exc).__name__}: {exc}"[:300]
        result["waited_s"] = time.monotonic() - start
        (out / "rank0.json").write_text(json.dumps(result))
    else:
        (out / "rank1.json").write_text(json.dumps(result))
        deadline = time.monotonic() + 120
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    os._exit(0)  # the group is broken on purpose: no teardown


def test_collective_timeout_and_reshard_after_forward(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(str(tmp_path),), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        assert time.monotonic() < deadline, "the 2 ranks did not finish"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # reshard_after_forward=True: the block is a sharded DTensor again after its forward; False: still gathered
    assert r0["True"] is True and r0["False"] is False and r1["True"] is True and r1["False"] is False
    assert r0["barrier"] != "returned" and "timed out" in r0["barrier"].lower(), r0["barrier"]
    print(f"a barrier rank 1 never joined failed after {r0['waited_s']:.1f} s (timeout 4 s)")


def _storage_worker(rank: int, out_dir: str) -> None:
    from postrl import distributed
    from postrl.storage import unshared_dir_problem

    out = Path(out_dir)
    # Two "nodes" of one rank each (LOCAL_WORLD_SIZE 1), as torchrun --nnodes 2 --nproc-per-node 1 describes them.
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    os.environ[distributed.RENDEZVOUS_FILE_ENV] = str(out / "store")
    assert distributed.init_process_group(timeout_s=60.0)
    shared = unshared_dir_problem(out / "shared")
    private = unshared_dir_problem(out / f"node{rank}")  # each node its own disk: what no_shared_storage means
    (out / f"storage{rank}.json").write_text(json.dumps({"shared": shared, "private": private}))
    distributed.teardown(wait_for_peers=True)


def test_a_checkpoint_dir_the_nodes_do_not_share_is_refused_at_start(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_storage_worker, args=(str(tmp_path),), nprocs=2, start_method="spawn", join=True)
    for r in range(2):
        got = json.loads((tmp_path / f"storage{r}.json").read_text())
        assert got["shared"] is None
        assert "is not shared by the nodes: node 0" in got["private"] and "Fix: point checkpoint.dir" in got["private"]
    assert list((tmp_path / "shared" / ".postrl_shared_check").iterdir()) == []  # the marks are cleaned up
