"""Scale-out: token-budget micro-batches, rank helpers, 2-process FSDP2 / DDP equivalence, torchrun and Ray.

The multi-process tests run on CPU over gloo, on loopback (127.0.0.1), with hard timeouts.
"""

from __future__ import annotations

import copy
import faulthandler
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from conftest import start_postrl, tiny_overrides, tiny_train_args

from postrl import distributed, launch, partition
from postrl.checks import load_config
from postrl.errors import UserError
from postrl.metrics import read_jsonl
from postrl.rewards.registry import register
from verifiers_for_tests import length_parity, vowel_share

# In-process copies of the test verifiers: no verifier worker pool to start in every rank.
register("dist_length_parity", in_process=True, uses_row=False)(length_parity)
register("dist_vowel_share", in_process=True, uses_row=False)(vowel_share)

PY = sys.executable
# The Ray launcher's tests run where Ray is installed (`make setup`), and are skipped, not failed, elsewhere.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed: pip install 'postrl[ray]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------- partitioning (in-process)


def test_balanced_partition_equal_sizes_and_balanced_loads():
    lengths = [50, 3, 40, 8, 22, 17, 9, 31, 12, 5, 44, 2]
    parts = partition.balanced_partition(lengths, 3, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(12))
    assert [len(p) for p in parts] == [4, 4, 4]
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths) // 2, loads
    assert parts == partition.balanced_partition(lengths, 3, equal_size=True)  # deterministic: same on every rank


def test_token_budget_micro_batches_fit_the_budget_and_cover_every_sequence_once():
    lengths = [30, 7, 12, 25, 9, 18, 3, 28, 14, 6]
    groups = partition.token_budget_micro_batches(lengths, max_token_len=40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 40 for g in groups)
    assert len(groups) == 4  # ceil(152 / 40): as few micro-batches as the budget allows
    # a sequence longer than the budget gets a micro-batch of its own
    groups = partition.token_budget_micro_batches([5, 90, 5], max_token_len=20)
    assert [1] in groups and sorted(i for g in groups for i in g) == [0, 1, 2]


def test_rank_helpers_are_identities_in_one_process():
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    assert partition.shard_range(10) == (0, 10)
    assert partition.shard_seed(1234, 0) == 1234
    assert partition.rank_rows([3, 1, 2, 5], mini_batch=2, balance=True) == [0, 1, 2, 3]
    assert distributed.all_reduce_sum([1.5, 2.0]) == [1.5, 2.0]
    assert distributed.all_reduce_sum_dict({"b": 1.0, "a": 2.0}) == {"a": 2.0, "b": 1.0}
    assert distributed.all_gather_object({"x": 1}) == [{"x": 1}]
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap_model(model) is model and not distributed.is_sharded(model)


def test_batch_sizes_that_do_not_split_over_the_ranks_are_refused(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, "train.global_batch_size=3", "rollout.n_samples_per_prompt=3"))
    with pytest.raises(UserError) as info:
        launch.check_world(cfg, 2)
    assert "do not split evenly over 2 processes" in info.value.problems[0]
    launch.check_world(cfg, 3)


# ---------------------------------------------------------------------- dynamic batching (in-process)


def test_dynamic_batching_gives_the_same_gradient_as_fixed_micro_batches(tmp_path):
    """One mini-batch through update_policy twice from the same weights: fixed micro-batches of 3
    sequences, then token-budget micro-batches (different composition, results scattered back by
    position). Gradients and the old log-probs (restored to the original order) agree to 1e-6."""
    from postrl.trainer import Trainer

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "reward.verifiers=[dist_vowel_share]", "train.micro_batch_size=3",
            "train.max_token_len_per_device=128", "train.total_steps=1", "algorithm.loss_agg_mode=token-mean",
        ),
    )  # fmt: skip
    tr = Trainer(cfg)
    batch, _ = tr.experience.collect(tr.step, tr.timer)
    adv_B = torch.linspace(-1, 1, batch.size)
    local = tr.actor.pack(batch, adv_B)
    model0 = copy.deepcopy(tr.model.state_dict())
    optim0 = copy.deepcopy(tr.actor.optimizer.state_dict())

    def run(dynamic: bool):
        tr.model.load_state_dict(model0)
        tr.actor.optimizer.load_state_dict(copy.deepcopy(optim0))
        tr.cfg.train.use_dynamic_bsz = dynamic
        chunks = [idx for idx, _ in tr.actor.micro_batches(range(local.size), local)]
        old = tr.actor.compute_logprobs(tr.model, local)
        stats = tr.actor.update(local)
        grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        return chunks, old, stats, grads

    fixed_chunks, fixed_old, fixed_stats, fixed = run(False)
    dyn_chunks, dyn_old, dyn_stats, dyn = run(True)
    assert fixed_chunks != dyn_chunks and len(dyn_chunks) > 1  # a genuinely different split
    lengths = local.lengths
    assert all(sum(lengths[i] for i in c) <= 128 for c in dyn_chunks if len(c) > 1)
    mask = local.tensors["response_mask"].bool()
    assert float((fixed_old - dyn_old)[mask].abs().max()) <= 1e-5
    assert fixed.keys() == dyn.keys() and len(fixed) > 10
    worst = max(float((fixed[k] - dyn[k]).abs().max()) for k in fixed)
    assert worst <= 1e-6, worst
    assert fixed_stats["actor/pg_loss"] == pytest.approx(dyn_stats["actor/pg_loss"], abs=1e-6)


# ----------------------------------------------------------------- 2 ranks vs 1 rank (multi-process)


class ScriptedRollout:
    """A rollout engine whose completions depend only on each prompt's tokens, not on the batch.

    The real engines seed a whole generate call, so the same 8 prompts split 8 / 2 x 4 would draw
    different samples. This engine derives each group from a hash of its prompt: a third of the
    prompts get n identical completions (zero spread: dropped by dynamic sampling), the others n
    random ones of 2..12 tokens (some end with EOS).
    """

    name = "scripted"

    def __init__(self, tokenizer):
        self.eos = tokenizer.eos_token_id
        self.vocab = range(3, len(tokenizer))  # ids 0-2 are the special tokens

    def generate(self, prompts, params, multi_modal=None):
        from postrl.rollout.base import Completion

        out = []
        for i, ids in enumerate(prompts):
            h = zlib.crc32(repr(list(ids)).encode())
            rng = random.Random(h)
            same = h % 3 == 0
            first = None
            for _ in range(params.n):
                if same and first is not None:
                    tokens = list(first)
                else:
                    tokens = [rng.choice(self.vocab) for _ in range(rng.randint(2, params.max_tokens))]
                    if len(tokens) < params.max_tokens and rng.random() < 0.5:
                        tokens.append(self.eos)
                    first = tokens
                out.append(Completion(prompt_index=i, token_ids=tokens, finished=tokens[-1] == self.eos))
        return out

    def sync_weights(self, model):
        pass

    def sleep(self):
        pass

    def probe_logprobs(self, token_ids):
        return None  # no weights of its own: nothing for the sync guard to check

    def close(self):
        pass


EQUIV_MODES = ("token-mean", "seq-mean-token-mean")


def _equiv_overrides(tmp_path: Path, mode: str, strategy: str = "fsdp2") -> list[str]:
    return tiny_overrides(
        tmp_path, f"train.strategy={strategy}", "algorithm.name=dapo", "algorithm.overlong_buffer.enable=false", f"algorithm.loss_agg_mode={mode}",
        "reward.verifiers=[dist_length_parity]", "train.global_batch_size=8", "train.gen_batch_size=8",
        "train.micro_batch_size=3", "train.lr=1e-4", "train.total_steps=1", "algorithm.filter_groups.max_num_gen_batches=0",
    )  # fmt: skip


def one_step(cfg) -> dict:
    """One train_step with the scripted rollout; the full parameters, gradients and batch afterwards."""
    from postrl.trainer import Trainer

    tr = Trainer(cfg)
    tr.engine = tr.experience.engine = ScriptedRollout(tr.tokenizer)
    batch, gen_stats = tr.experience.collect(tr.step, tr.timer)
    tr.experience.collect = lambda step, timer: (batch, gen_stats)  # the step below trains on exactly this batch
    before = {n: t.clone() for n, t in distributed.full_state_dict(tr.model)}
    metrics = tr.train_step()
    tr.logger.close()
    tr.run.reward_fn.close()
    grads = {}
    for name, p in tr.model.named_parameters():
        g = p.grad
        if g is None:  # frozen (LoRA's base)
            continue
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    params = {n: t.clone() for n, t in distributed.full_state_dict(tr.model)}
    return {
        "params": params,
        "sharded": distributed.is_sharded(tr.model),
        "scaler": type(tr.actor.scaler).__name__,
        "moved": max(float((params[n] - t).abs().max()) for n, t in before.items()),
        "grads": grads,
        "responses": batch.response_ids,
        "prompts": batch.prompt_ids[:: cfg.rollout.n_samples_per_prompt],
        "metrics": {k: metrics.get(k) for k in ("dapo/kept_groups_ratio", "dapo/num_gen_batches", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/loss_scale")},
    }


STRATEGIES = ("fsdp2", "ddp")


def _grad_gap(run: dict, reference: dict) -> float:
    """The largest |gradient difference| of a tensor relative to the largest entry of the reference's."""
    return max(float((run["grads"][n] - g).abs().max()) / max(float(g.abs().max()), 1e-6) for n, g in reference["grads"].items())


BF16_KL = ["model.dtype=bfloat16", "algorithm.kl.coef=0.01"]  # FSDP2 mixed precision, and a bf16 reference
LORA_KL = ["model.lora_rank=4", "model.lora_alpha=8", "algorithm.kl.coef=0.01"]  # adapters; the base is the reference


def _equiv_worker(local_rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), LOCAL_RANK=str(local_rank),
        WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    log = open(Path(out_dir) / f"rank{local_rank}.log", "w")  # noqa: SIM115 (open until the process ends)
    os.dup2(log.fileno(), 2)  # a native abort's message and faulthandler's stack land here for the test to show
    faulthandler.enable()
    torch.set_num_threads(1)
    distributed.init_process_group(timeout_s=120)
    finished = False
    try:
        for strategy in STRATEGIES:
            for mode in EQUIV_MODES:
                cfg = load_config(None, _equiv_overrides(Path(out_dir) / f"r{local_rank}", mode, strategy))
                result = one_step(cfg)
                seen = distributed.all_gather_object((result["responses"], result["metrics"]["dapo/kept_groups_ratio"]))
                result["same_batch_on_every_rank"] = all(s == seen[0] for s in seen)
                if distributed.is_main():
                    torch.save(result, Path(out_dir) / f"{strategy}_{mode}.pt")
        bf16 = _equiv_overrides(Path(out_dir) / f"r{local_rank}-bf16", "token-mean") + BF16_KL
        result = one_step(load_config(None, bf16))
        result["master_dtypes"] = {p.dtype for p in result["params"].values()}
        if distributed.is_main():
            torch.save(result, Path(out_dir) / "fsdp2_bf16.pt")
        fp16 = _equiv_overrides(Path(out_dir) / f"r{local_rank}-fp16", "token-mean") + ["model.dtype=float16"]
        result = one_step(load_config(None, fp16))
        result["loss_scales"] = distributed.all_gather_object(result["metrics"]["actor/loss_scale"])
        if distributed.is_main():
            torch.save(result, Path(out_dir) / "fsdp2_fp16.pt")
        adapters = _equiv_overrides(Path(out_dir) / f"r{local_rank}-lora", "token-mean") + LORA_KL
        result = one_step(load_config(None, adapters))
        if distributed.is_main():
            torch.save(result, Path(out_dir) / "fsdp2_lora.pt")
        finished = True
    finally:
        distributed.teardown(wait_for_peers=finished)


@pytest.mark.slow
def test_two_ranks_of_four_prompts_update_like_one_rank_of_eight(tmp_path):
    """One DAPO step (dynamic sampling on) with 2 ranks x 4 prompts gives the parameters of 1 rank x 8.

    Choice of rollout: both runs must train on the same global batch, so completions come from
    `ScriptedRollout`, which derives each group from its prompt's tokens alone (the real engines seed
    a whole generate call, so their samples depend on how prompts are split). Everything after the
    engine is the real path: per-rank prompt slices, rewards, the gather, dynamic sampling (a third
    of the groups have zero spread, so several generation batches are drawn and the batch is cut),
    advantages, the per-rank shard, normalisers summed over ranks, FSDP2 or DDP gradient reduction.
    Checked for token-mean and seq-mean-token-mean: the batch, the dynamic-sampling counts, the
    gradients and the updated parameters. Micro-batches of 3 sequences make each rank accumulate
    gradients over several passes. Updated parameters must agree within 1e-5 and gradients within
    1e-5 of their scale (AdamW's first step is close to lr x sign(gradient), so the gradient is the
    sharper check). HF generation under FSDP2 is covered by the torchrun and Ray tests. Last, the
    same token-mean step with bf16 compute (FSDP2's MixedPrecisionPolicy, fp32 masters) and a bf16
    KL reference: KL exactly 0 at the first step, the gradient within bf16 rounding of fp32; and with
    fp16 compute, whose loss scaler must agree across the ranks that each hold a shard of the gradients;
    and LoRA adapters on a frozen base.
    """
    import torch.multiprocessing as mp

    ranks = mp.start_processes(_equiv_worker, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + 300
    try:
        while not ranks.join(timeout=5):  # raises if a rank failed
            if time.monotonic() > deadline:
                pytest.fail("the 2 ranks did not finish within 300 s")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        tails = {r: (tmp_path / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(2)}
        pytest.fail(f"{exc}\n" + "\n".join(f"--- rank {r} stderr (end) ---\n{t}" for r, t in tails.items()))
    finally:
        for p in ranks.processes:
            if p.is_alive():
                p.kill()
    for mode, strategy in [(m, s) for m in EQUIV_MODES for s in STRATEGIES]:
        if strategy == STRATEGIES[0]:
            one = one_step(load_config(None, _equiv_overrides(tmp_path / "single", mode)))
        two = torch.load(tmp_path / f"{strategy}_{mode}.pt", weights_only=False)
        assert two["sharded"] == (strategy == "fsdp2") and two["same_batch_on_every_rank"]
        assert two["prompts"] == one["prompts"] and two["responses"] == one["responses"]
        for key in ("dapo/kept_groups_ratio", "dapo/num_gen_batches"):
            assert two["metrics"][key] == one["metrics"][key]
        assert one["metrics"]["dapo/kept_groups_ratio"] < 1 and one["metrics"]["dapo/num_gen_batches"] > 1  # refilled
        assert two["metrics"]["actor/pg_loss"] == pytest.approx(one["metrics"]["actor/pg_loss"], abs=1e-6)
        assert two["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=1e-5)
        grad_err = _grad_gap(two, one)
        assert two["params"].keys() == one["params"].keys()
        param_err = max(float((two["params"][n] - p).abs().max()) for n, p in one["params"].items())
        print(f"{strategy} {mode}: max |grad diff| / max |grad| {grad_err:.1e}, max |param diff| {param_err:.1e}")
        assert grad_err <= 1e-5 and param_err <= 1e-5, (strategy, mode, grad_err, param_err)
        assert one["moved"] > 5e-5  # the step did update the weights (lr 1e-4)
        if mode == "token-mean":
            one_fp32 = one
    # FSDP2 with bf16 compute (MixedPrecisionPolicy): the multi-GPU recipe's numerics, on gloo.
    bf16 = torch.load(tmp_path / "fsdp2_bf16.pt", weights_only=False)
    assert bf16["sharded"] and bf16["responses"] == one_fp32["responses"]
    assert bf16["master_dtypes"] == {torch.float32}  # fp32 masters behind the bf16 compute
    # Policy and reference both compute from the same bf16 weights, RoPE in fp32 for both: KL exactly 0.
    assert bf16["metrics"]["actor/kl_loss"] == 0.0
    assert bf16["metrics"]["actor/grad_norm"] == pytest.approx(one_fp32["metrics"]["actor/grad_norm"], rel=1e-2)
    grad_err = _grad_gap(bf16, one_fp32)
    print(f"fsdp2 bf16 vs one rank fp32: max |grad diff| / max |grad| {grad_err:.1e}")
    assert 0 < grad_err <= 0.1  # bf16 ran; its per-element gap is a few u = 2^-8 of the largest gradient (measured 3e-2)
    # fp16 compute under FSDP2: ShardedGradScaler, one loss scale on every rank, the gradient close to fp32.
    fp16 = torch.load(tmp_path / "fsdp2_fp16.pt", weights_only=False)
    assert fp16["sharded"] and fp16["scaler"] == "ShardedGradScaler" and fp16["loss_scales"] == [2.0**16, 2.0**16]
    assert fp16["metrics"]["actor/grad_norm"] == pytest.approx(one_fp32["metrics"]["actor/grad_norm"], rel=1e-3)
    grad_err = _grad_gap(fp16, one_fp32)
    print(f"fsdp2 fp16 vs one rank fp32: max |grad diff| / max |grad| {grad_err:.1e}")
    assert 0 < grad_err <= 1e-2  # fp16 keeps 11 significant bits: 8x closer than bf16
    # LoRA adapters under FSDP2 (a frozen base sharded beside trainable adapters): the adapters' gradients
    # and the merged weights of one rank of eight, and the reference (adapters off) equal to the policy at first.
    one = one_step(load_config(None, _equiv_overrides(tmp_path / "single-lora", "token-mean") + LORA_KL))
    two = torch.load(tmp_path / "fsdp2_lora.pt", weights_only=False)
    assert two["sharded"] and two["responses"] == one["responses"]
    assert two["grads"].keys() == one["grads"].keys() and all(".lora_" in n for n in one["grads"])
    assert one["metrics"]["actor/kl_loss"] == two["metrics"]["actor/kl_loss"] == 0.0
    grad_err = _grad_gap(two, one)
    param_err = max(float((two["params"][n] - p).abs().max()) for n, p in one["params"].items())
    print(f"fsdp2 lora: max |grad diff| / max |grad| {grad_err:.1e}, max |param diff| {param_err:.1e}")
    assert grad_err <= 1e-5 and param_err <= 1e-5 and one["moved"] > 0


# ------------------------------------------------------------------------------- launchers (real runs)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _launcher_args(tmp_path: Path, *extra: str) -> list[str]:
    return tiny_train_args(tmp_path, "reward.verifiers=[acc_for_dapo]", "train.total_steps=2", "checkpoint.save_final=true", *extra)


def _check_run(run_dir: Path, out: str, steps: int) -> None:
    """Rank 0 alone wrote the metrics and the checkpoint; every rank wrote its optimizer shard and RNG."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "timing/all" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), out[-3000:]  # one line per step, not per rank
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps)
    it = ckpt / f"iter_{steps:07d}"
    assert {p.name for p in (it / "optimizer").iterdir()} == {"rank0.pt", "rank1.pt"}
    assert (it / "rng_rank1.pt").exists() and (it / "model" / "model.safetensors").exists()
    config = (it / "model" / "config.json").read_text()
    assert '"Qwen2ForCausalLM"' in config  # the plain class name, not the FSDP wrapper's
    assert out.count("step    1 |") == 1, out[-3000:]  # only rank 0 prints


@pytest.mark.slow
def test_nproc_2_trains_on_loopback_only_with_dynamic_batch_size(tmp_path):
    """`postrl train --nproc 2`: 2 ranks on this machine, FSDP2, HF rollout on the unsharded weights,
    token-budget micro-batches with counts synced over ranks; 2 steps and a checkpoint. While it runs,
    no process of the job listens on anything but loopback (psutil reads the sockets)."""
    import psutil

    args = _launcher_args(tmp_path, "train.use_dynamic_bsz=true", "train.max_token_len_per_device=160")
    proc = start_postrl(*args, "--nproc", "2", env={"GLOO_SOCKET_IFNAME": None},  # the launcher itself must pick loopback
                        stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)  # fmt: skip
    listening: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 200
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                for p in family:
                    listening |= {c.laddr[:2] for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:  # a process ended between the listing and the read
                pass
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    _check_run(tmp_path / "run", out, steps=2)
    assert listening, "the ranks' collectives listen somewhere: the scan should have seen them"
    assert all(host in ("127.0.0.1", "::1") for host, _port in listening), listening


RAY_DRIVER = """
import sys
import ray
from postrl.cli import main

# A one-node cluster on loopback, started (and stopped) by this driver: the head plus the
# TorchTrainer's 2 one-CPU workers.
ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False,
         _node_ip_address="127.0.0.1")
try:
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:"), address
    code = main(["train", *sys.argv[1:], "--ray-address", address])
finally:
    ray.shutdown()
sys.exit(code)
"""


@pytest.mark.slow
@needs_ray
def test_ray_cluster_on_loopback_trains_two_steps_and_checkpoints(tmp_path):
    """cluster.launcher: ray through --ray-address: Ray Train's TorchTrainer runs 2 CPU workers of the
    same SPMD loop (FSDP2 over gloo); afterwards no process of the Ray cluster is left running."""
    train_args = _launcher_args(tmp_path, "cluster.launcher=ray", "cluster.devices_per_node=2")
    env = dict(
        os.environ, GLOO_SOCKET_IFNAME="lo", RAY_USAGE_STATS_ENABLED="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # keep every Ray address on 127.0.0.1 (Ray would pick the LAN IP)
    )  # fmt: skip
    proc = subprocess.Popen(
        [PY, "-c", RAY_DRIVER, *train_args[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=300)
        left = _session_pids(proc.pid)
        for _ in range(20):  # ray.shutdown() stops the node; give its processes a moment to exit
            if not left:
                break
            subprocess.run(["sleep", "1"])
            left = _session_pids(proc.pid)
    except subprocess.TimeoutExpired:
        out, left = "timed out after 300 s", None
    finally:
        for pid in _session_pids(proc.pid):  # whatever is left of this test's cluster
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert left is not None and proc.returncode == 0, out[-4000:]
    assert not left, f"Ray processes still running after ray.shutdown(): {left}"
    assert "RayTrainWorker" in out and "world_rank=1" in out, out[-3000:]
    _check_run(tmp_path / "run", out, steps=2)


@pytest.mark.slow
@needs_ray
def test_a_local_ray_cluster_listens_on_loopback_only(tmp_path):
    """cluster.launcher: ray without an address: postrl starts a one-node Ray cluster for the job. While
    it trains, nothing of the job listens beyond loopback: Ray's servers (GCS, raylet, runtime-env agent,
    core workers) bind 127.0.0.1, and the workers build their process group from a file, without the TCP
    store (it binds every interface) that Ray Train's TorchConfig would open in rank 0."""
    import psutil

    args = _launcher_args(tmp_path, "cluster.launcher=ray", "cluster.devices_per_node=2", "train.total_steps=3")
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER and GLOO_SOCKET_IFNAME unset: the launcher itself must keep Ray and the collectives on loopback
    env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": None, "GLOO_SOCKET_IFNAME": None}
    proc = start_postrl(*args, env=env, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    listening: set[tuple[str, int, str]] = set()
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for p in psutil.process_iter(["pid"]):  # Ray's servers are not all children of the driver
                try:
                    if os.getsid(p.pid) != proc.pid:
                        continue
                    name = p.name()
                    listening |= {(c.laddr[0], c.laddr[1], name) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
                except (psutil.Error, ProcessLookupError):
                    pass
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for pid in _session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, out[-4000:]
    assert any(name == "gcs_server" for *_, name in listening), listening  # the scan saw Ray's servers
    outside = {x for x in listening if x[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")}
    assert not outside, outside
