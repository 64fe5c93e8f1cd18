"""Ulysses sequence parallelism in training (train.sequence_parallel_size): the actor's passes on 2 gloo ranks
with SP 2 (one sequence-parallel group, FSDP2 over both ranks) against one process, on the same batch.

Both runs train on the batch of `ScriptedRollout` (completions from each prompt's tokens alone, so the batch
does not depend on the ranks). Checked with padded rows (train.use_remove_padding=false) and packed rows
(true, a group's prompt once), packed with gradient checkpointing under DDP, and rows with images (the tiny
Qwen2.5-VL and a random tiny Qwen3-VL with deepstack features, vision towers trained: features and mRoPE positions
of the whole rows, then split), micro-batches of 3 sequences (gradient accumulation and padding inside
micro-batches), token-mean loss with a KL term and an entropy bonus (every term the update gathers):
the old and reference log-probs within 1e-5 of one rank and the gradients of the update within 1e-4,
and the metrics (normalised over the data-parallel group, not counted once per sequence-parallel rank).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_postrl, tiny_overrides, tiny_train_args
from test_distributed import ScriptedRollout  # also registers the in-process test verifiers

from postrl.checks import load_config

HERE = Path(__file__).resolve().parent
LAYOUTS = {
    "padded": ["train.use_remove_padding=false"],
    "packed": ["train.use_remove_padding=true"],
    # recomputation in the backward runs the Ulysses attention again, with the same mask and all-to-alls
    "packed, gradient checkpointing, DDP": ["train.use_remove_padding=true", "model.gradient_checkpointing=true", "train.strategy=ddp"],
    # image features and mRoPE positions built over the whole rows, then split; the vision tower trains too
    "images (Qwen2.5-VL)": [
        "model.path=builtin:tiny-qwen2.5-vl", "model.freeze_vision_tower=false", "data.train_files=[builtin:shapes:train]",
        "data.shapes.train_size=16", "rollout.max_tokens=8",
    ],
    # Qwen3-VL: deepstack features added to the image tokens of the first layers, sliced with them
    "images (Qwen3-VL, deepstack)": [
        "model.path={models}/qwen3_vl", "model.freeze_vision_tower=false", "data.train_files=[builtin:shapes:train]",
        "data.shapes.train_size=16", "rollout.max_tokens=8",
    ],
}
METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


def _overrides(tmp_path: Path, layout: str, sp: int, models: Path) -> list[str]:
    """The run's settings; `models` holds the random tiny models of other families (`_family_dir`)."""
    return tiny_overrides(
        tmp_path, "train.strategy=fsdp2", "algorithm.loss_agg_mode=token-mean", "reward.verifiers=[dist_length_parity]",
        "train.global_batch_size=4", "train.micro_batch_size=3", "train.lr=1e-4", "train.total_steps=1",
        "algorithm.kl.coef=0.05", "algorithm.entropy_coef=0.01", "rollout.max_tokens=16",
        f"train.sequence_parallel_size={sp}", f"cluster.devices_per_node={sp}", *(o.format(models=models) for o in LAYOUTS[layout]),
    )  # fmt: skip


def _slug(layout: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in layout)


def sp_step(cfg) -> dict:
    """The old / reference log-prob passes and one update on the scripted batch; log-probs, gradients, metrics."""
    from postrl.trainer import Trainer

    tr = Trainer(cfg)
    try:
        rollout = ScriptedRollout(tr.tokenizer)
        rollout.vocab = [t for t in rollout.vocab if t not in set(tr.run.policy.modality.suppress_token_ids())]  # no image placeholders
        tr.engine = tr.experience.engine = rollout
        batch, _ = tr.experience.collect(tr.step, tr.timer)
        local = tr.actor.pack(batch, tr.experience.advantages(batch))
        local.tensors["old_logp"] = tr.actor.compute_logprobs(tr.model, local)
        local.tensors["ref_logp"] = tr.actor.compute_logprobs(tr.ref_model, local)
        metrics = tr.actor.update(local, use_ref=True)
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone() for n, p in tr.model.named_parameters()}
        mask = local.tensors["response_mask"].bool()
        return {
            "old_logp": local.tensors["old_logp"][mask],
            "ref_logp": local.tensors["ref_logp"][mask],
            "grads": grads,
            "metrics": {k: metrics[k] for k in METRICS},
            "responses": batch.response_ids,
        }
    finally:
        tr.close()


def _worker(rank: int, port: int, out_dir: str, layouts: list[str]) -> None:
    from postrl import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    distributed.init_process_group(timeout_s=120)
    finished = False
    try:
        for layout in layouts:
            run_dir = Path(out_dir) / f"r{rank}-{_slug(layout)}"
            result = sp_step(load_config(None, _overrides(run_dir, layout, 2, Path(out_dir) / "models")))
            if rank == 0:
                torch.save(result, Path(out_dir) / f"{_slug(layout)}.pt")
        finished = True
    finally:
        distributed.teardown(wait_for_peers=finished)


def _run_two_ranks(tmp_path: Path, layouts: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_sequence_parallel_training import _worker; _worker(int(sys.argv[1]), {port}, {str(tmp_path)!r}, {layouts!r})"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=420)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)


@pytest.mark.slow
def test_sequence_parallel_2_trains_like_one_rank_padded_and_packed(tmp_path):
    from test_vision import _family_dir

    _family_dir("qwen3_vl", tmp_path / "models" / "qwen3_vl")
    _run_two_ranks(tmp_path, list(LAYOUTS))
    for layout in LAYOUTS:
        one = sp_step(load_config(None, _overrides(tmp_path / f"single-{_slug(layout)}", layout, 1, tmp_path / "models")))
        two = torch.load(tmp_path / f"{_slug(layout)}.pt", weights_only=False)
        assert two["responses"] == one["responses"]
        logp = max(float((two[k] - one[k]).abs().max()) for k in ("old_logp", "ref_logp"))
        grad = max(float((two["grads"][n] - g).abs().max()) for n, g in one["grads"].items())
        scale = max(float(g.abs().max()) for g in one["grads"].values())
        print(f"SP 2 vs one rank, {layout}: max |logp diff| {logp:.1e}, max |grad diff| {grad:.1e} (max |grad| {scale:.2f}); "
              f"metrics {two['metrics']} vs {one['metrics']}")  # fmt: skip
        assert one["old_logp"].numel() > 20 and scale > 1e-2  # real tokens, gradients that are not all zero
        assert logp <= 1e-5, (layout, logp)
        assert grad <= 1e-4, (layout, grad)
        for k in METRICS:
            assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-4, abs=1e-6), (layout, k)


def test_check_world_counts_data_parallel_ranks():
    """A mini-batch splits over world / sequence_parallel_size ranks; the size must divide the processes."""
    from postrl import launch
    from postrl.errors import UserError

    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "rollout.n_samples_per_prompt=4", "train.global_batch_size=2", "train.gen_batch_size=8",
                             "train.sequence_parallel_size=2"])  # fmt: skip
    launch.check_world(cfg, 4)  # 2 x 4 sequences over 2 data-parallel ranks
    with pytest.raises(UserError, match=r"over 3 data-parallel ranks \(6 processes / sequence_parallel_size 2\)"):
        launch.check_world(cfg, 6)
    with pytest.raises(UserError, match=r"train.sequence_parallel_size \(2\) must divide the 3 processes"):
        launch.check_world(cfg, 3)


@pytest.mark.slow
def test_two_step_grpo_run_with_sequence_parallel_2_on_two_ranks(tmp_path):
    """`postrl train --nproc 2` with train.sequence_parallel_size=2: one sequence-parallel group of 2 ranks, FSDP2,
    HF rollout, 2 GRPO steps with a KL reference and packed rows, a verifier whose rewards spread (completion length
    parity); the losses are finite and rank 0 logs both steps."""
    import math

    from postrl.metrics import read_jsonl

    args = tiny_train_args(
        tmp_path, "reward.verifiers=[verifiers_for_tests:length_parity]", "train.total_steps=2", "train.sequence_parallel_size=2",
        "algorithm.kl.coef=0.01", "train.use_remove_padding=true",
    )  # fmt: skip
    proc = run_postrl(*args, "--nproc", "2", cwd=tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    assert [r["step"] for r in rows] == [1, 2], out[-3000:]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy")), r
    assert all(r["actor/grad_norm"] > 0 for r in rows)  # rewards with spread: the policy gradient is not zero
    assert rows[1]["actor/kl_loss"] > 0  # the reference pass ran, and step 1 moved the policy away from it
    print({k: [r[k] for r in rows] for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "timing/all")})
