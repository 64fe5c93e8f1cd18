"""Ulysses sequence parallelism (postrl.sequence_parallel): 2 gloo ranks against one process, on the tiny
Qwen2 (GQA: 4 query heads, 2 key / value heads) in float32, with padded rows and with a packed row."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from postrl import sequence_parallel as sp

HERE = Path(__file__).resolve().parent


def test_the_full_sequence_mask_by_hand():
    """Row 0: one left pad then 3 tokens; row 1: two packed segments of 2 tokens (positions 0 1 0 1)."""
    mask = sp.full_mask(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), torch.tensor([[0, 0, 1, 2], [0, 1, 0, 1]]))
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


SEQS = [[5, 17, 23, 42, 8, 99, 3], [61, 12, 7, 7, 31, 2, 88, 14, 9, 40, 16], [70, 4, 25, 51, 6]]


def _layouts(pad: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]]:
    """(ids, attention mask, positions, [(row, start, length)] of each sequence) for the padded and packed layouts."""
    S = max(map(len, SEQS)) + 1
    ids, att, pos, where = torch.full((3, S), pad), torch.zeros(3, S, dtype=torch.long), torch.zeros(3, S, dtype=torch.long), []
    for i, s in enumerate(SEQS):
        start = 1 if i == 0 else 0  # row 0 left-padded by one, the others right-padded
        ids[i, start : start + len(s)] = torch.tensor(s)
        att[i, start : start + len(s)] = 1
        pos[i, start : start + len(s)] = torch.arange(len(s))
        where.append((i, start, len(s)))
    flat = [t for s in SEQS for t in s]
    packed_pos = torch.cat([torch.arange(len(s)) for s in SEQS])[None]
    offsets = [sum(map(len, SEQS[:i])) for i in range(3)]
    packed = (torch.tensor([flat]), torch.ones(1, len(flat), dtype=torch.long), packed_pos, [(0, o, len(s)) for o, s in zip(offsets, SEQS)])
    return {"padded": (ids, att, pos, where), "packed": packed}


def _loss(logps: list[torch.Tensor]) -> torch.Tensor:
    return sum((lp * torch.cos(torch.arange(len(lp), dtype=torch.float32))).sum() for lp in logps)


def _worker(rank: int, port: int, model_path: str, out: str) -> None:
    import torch.distributed as dist

    from postrl.models import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = load_model(model_path)
    model.eval()
    results = {}
    for name, (ids, att, pos, where) in _layouts(model.config.pad_token_id or 0).items():
        # One process: every sequence alone, no padding.
        model.zero_grad()
        alone = []
        for row, start, n in where:
            x = ids[row, start : start + n][None]
            logp = torch.log_softmax(model(input_ids=x).logits.float(), -1)[0, :-1].gather(-1, x[0, 1:, None])[:, 0]
            alone.append(logp)
        _loss(alone).backward()
        reference = {k: p.grad.clone() for k, p in model.named_parameters()}
        # Two ranks, each with half of every row.
        model.zero_grad()
        logp_BS = sp.token_logprobs(model, ids, att, pos, group=dist.group.WORLD)
        split = [logp_BS[row, start : start + n - 1] for row, start, n in where]
        _loss(split).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # what the data-parallel reduction does
        results[name] = {
            "logp": max(float((a - b).abs().max()) for a, b in zip(split, alone)),
            "grad": max(float((p.grad - reference[k]).abs().max()) for k, p in model.named_parameters()),
            "grad_scale": max(float(g.abs().max()) for g in reference.values()),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def test_two_sequence_parallel_ranks_match_one_rank(tiny_model_path, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "sp.json"
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_sequence_parallel import _worker; _worker(int(sys.argv[1]), {port}, {tiny_model_path!r}, {str(out)!r})"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = json.loads(out.read_text())
    print(results)
    for layout in ("padded", "packed"):
        assert results[layout]["logp"] < 1e-5, results
        assert results[layout]["grad"] < 1e-4, results
        assert results[layout]["grad_scale"] > 1e-2  # the gradients compared are not all zero


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
