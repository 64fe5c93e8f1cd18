"""The training loop on the tiny model: metrics, dynamic sampling, errors, pinned losses, learning."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_overrides

from postrl.checks import load_config
from postrl.errors import UserError
from postrl.metrics import read_jsonl
from postrl.trainer import Trainer, train

METRICS = [
    "timing/all", "timing/rollout", "timing/reward", "timing/old_log_p", "timing/reference_model", "timing/adv",
    "timing/update", "timing/resharding_to_infer", "timing/resharding_to_train",
    "actor/entropy", "actor/kl_loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
    "actor/ppo_kl", "actor/grad_norm", "actor/lr",
    "dapo/rewards/mean", "dapo/rewards/max", "dapo/rewards/min", "dapo/score/mean", "dapo/score/max", "dapo/score/min",
    "response_length/mean", "response_length/min", "response_length/max", "response_length/clip_ratio",
    "prompt_length/mean", "prompt_length/min", "prompt_length/max",
    "dapo/num_gen_batches", "dapo/kept_groups_ratio", "e2e_tps", "update_tps", "vllm_tps",
]  # fmt: skip


def test_dapo_run_logs_every_metric_and_filters_groups(tmp_path):
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path,
            "algorithm.name=dapo",
            "algorithm.overlong_buffer.len=4",
            "reward.verifiers=[verifiers_for_tests:length_parity]",
            "train.gen_batch_size=6",
            "eval.after_train=true",
            "eval.max_prompts=8",
        ),
    )
    train(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "timing/all" in r]
    assert len(steps) == 3
    for name in METRICS:
        assert name in steps[0], name
    assert "dapo/verifiers_for_tests:length_parity/mean" in steps[0]
    assert any(k.startswith("val/arithmetic/acc_mean@1") for k in rows[-1])
    # Dynamic sampling: 4 samples of a fair coin make a uniform group 1 time in 8; over 3 steps x >= 6
    # groups, some group was dropped, and each batch still has exactly global_batch_size groups.
    assert all(r["dapo/kept_groups_ratio"] <= 1 for r in steps)
    assert min(r["dapo/kept_groups_ratio"] for r in steps) < 1
    for r in steps:
        assert r["dapo/num_gen_batches"] >= 1
        # the throughput formula of the guides, recomputed from the logged parts
        tokens = (r["response_length/mean"] + r["prompt_length/mean"]) * 4 * 4
        assert r["e2e_tps"] == pytest.approx(tokens / r["timing/all"])
        assert r["update_tps"] == pytest.approx(tokens / r["timing/update"])
        assert r["vllm_tps"] == pytest.approx(tokens / r["timing/rollout"])
        # overlong shaping: rewards never exceed scores, and only long responses are penalised
        assert r["dapo/rewards/mean"] <= r["dapo/score/mean"] + 1e-9


def test_too_hard_data_stops_with_a_clear_error(tmp_path):
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "algorithm.name=dapo", "reward.verifiers=[verifiers_for_tests:never]",
            "algorithm.filter_groups.max_num_gen_batches=2", "algorithm.overlong_buffer.len=4",
        ),
    )  # fmt: skip
    with pytest.raises(UserError) as info:
        train(cfg)
    msg = info.value.problems[0]
    assert "drew 2 generation batches" in msg and "too hard or too easy" in msg and "max_num_gen_batches" in msg


def test_grpo_with_kl_and_ppo_epochs_runs_the_old_and_ref_passes(tmp_path):
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "reward.verifiers=[verifiers_for_tests:length_parity]", "algorithm.kl.coef=0.1",
            "train.epochs_per_batch=2", "train.mini_batch_size=2", "train.total_steps=1",
        ),
    )  # fmt: skip
    metrics = train(cfg)
    assert metrics["timing/old_log_p"] > 0 and metrics["timing/reference_model"] > 0
    # two mini-batches x two epochs: the policy moved away from the reference and the old policy
    assert metrics["actor/kl_loss"] > 0
    assert metrics["actor/ppo_kl"] != 0


def test_three_steps_from_a_fixed_seed_pin_the_losses(tmp_path):
    """Regression: CPU fp32, fixed seed, 3 steps; the logged losses are pinned."""
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "reward.verifiers=[verifiers_for_tests:vowel_share]", "train.lr=1e-3",
            "train.epochs_per_batch=2", "train.deterministic=true",
        ),
    )  # fmt: skip
    train(cfg)
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    got = [[round(r["actor/pg_loss"], 6), round(r["actor/grad_norm"], 5), round(r["grpo/rewards/mean"], 6)] for r in steps]
    print(json.dumps(got))
    assert got == PINNED


PINNED = [[-0.029332, 1.46917, 0.329298], [-0.04125, 0.86563, 0.347167], [-0.027955, 0.7951, 0.337112]]


def test_packing_without_padding_trains_the_same(tmp_path):
    """train.use_remove_padding (prompts shared within a group, no padding) gives the losses of the padded run."""
    runs = []
    for packed in (False, True):
        cfg = load_config(
            None,
            tiny_overrides(
                tmp_path / str(packed), "reward.verifiers=[verifiers_for_tests:vowel_share]", "train.lr=1e-3",
                "train.epochs_per_batch=2", "train.total_steps=2", f"train.use_remove_padding={packed}",
            ),
        )  # fmt: skip
        train(cfg)
        runs.append([r for r in read_jsonl(tmp_path / str(packed) / "run" / "metrics.jsonl") if "timing/all" in r])
    assert len(runs[0]) == len(runs[1]) == 2
    for padded, packed in zip(*runs):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "grpo/rewards/mean"):
            assert abs(padded[key] - packed[key]) < 1e-5, (key, padded[key], packed[key])


@pytest.mark.slow
def test_grpo_learns_a_dense_reward(tmp_path):
    """20 steps of GRPO raise the vowel share of the tiny model's completions (learning happens)."""
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "reward.verifiers=[verifiers_for_tests:vowel_share]", "train.lr=3e-3", "train.total_steps=20",
            "train.global_batch_size=8", "train.micro_batch_size=32", "rollout.n_samples_per_prompt=8",
        ),
    )  # fmt: skip
    train(cfg)
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    first = sum(r["grpo/rewards/mean"] for r in steps[:4]) / 4
    last = sum(r["grpo/rewards/mean"] for r in steps[-4:]) / 4
    assert last > first + 0.15, (first, last)


def test_logprobs_of_the_update_pass_equal_a_separate_no_grad_pass(tmp_path):
    """The on-policy shortcut is exact: old log-probs from the update pass equal those of a separate pass."""
    cfg = load_config(None, tiny_overrides(tmp_path, "reward.verifiers=[verifiers_for_tests:length_parity]"))
    tr = Trainer(cfg)
    batch, _ = tr.experience.collect(tr.step, tr.timer)
    packed = tr.actor.pack(batch, torch.zeros(batch.size))
    separate = tr.actor.compute_logprobs(tr.model, packed)
    from postrl.models import response_logprobs

    t = packed.tensors
    T = t["response_mask"].shape[1]
    full, _ = response_logprobs(tr.model, t["input_ids"], t["attention_mask"], t["position_ids"], T, 1.0)
    mask = t["response_mask"].bool()
    assert torch.allclose(separate[mask], full[mask], atol=1e-5)


def test_thread_policy_uses_the_cores_this_process_may_use(monkeypatch):
    """auto: cores of the affinity set / processes on the machine, whatever the load; load: capped by the
    idle cores; a number wins over OMP_NUM_THREADS, which wins over both policies."""
    import os

    import postrl.runtime
    from postrl.runtime import threads_for

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(postrl.runtime, "_own_load", lambda: 0.0)  # the load below is all other processes
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    load = [0.3]
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    assert threads_for(model)[0] == 8  # alone on an idle machine: every usable core
    assert threads_for(model, "load")[0] == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads_for(model)[0] == 4  # two ranks on this machine (--nproc 2): half each
    load[0] = 6.6  # other processes keep 7 of the 8 cores busy
    n, why = threads_for(model)
    assert n == 4 and why == "train.num_threads auto: 8 usable cores / 2 processes"  # the same command, the same count
    n, why = threads_for(model, "load")  # one thread, not four spinning ones
    assert n == 1 and why.startswith("train.num_threads load: 8 usable cores / 2 processes, 1 idle (load 6.6")
    assert threads_for(model, requested=3) == (3, "train.num_threads: 3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # conftest's setting: torch's own count stays
    assert threads_for(model, "load")[0] is None and threads_for(model)[1] == "OMP_NUM_THREADS=1"
    assert threads_for(model, requested=3)[0] == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # empty (libgomp ignores it): the policy decides, not torch's 2 per process
    assert threads_for(model, per_rank=2)[0] == 2  # LOCAL_WORLD_SIZE 2 x (trainer + rollout worker) on 8 cores


def test_data_that_stops_the_run_mid_way_keeps_the_steps_trained_so_far(tmp_path):
    """Dynamic sampling runs dry at step 2 (every group uniform from then on): the run stops with the
    data error, and a checkpoint of step 1, taken as it was before step 2 began, is there to resume."""
    from postrl import checkpoint
    from postrl.rewards.registry import register

    calls = []

    @register("dries_up_after_one_batch", in_process=True)
    def dries_up(completion: str, ground_truth: str, row: dict) -> dict:
        calls.append(1)
        ok = float(len(completion) % 2 == 0) if len(calls) <= 16 else 0.0  # the first step's 16 completions
        return {"score": ok, "acc": ok}

    cfg = load_config(None, tiny_overrides(
        tmp_path, "algorithm.name=dapo", "reward.verifiers=[dries_up_after_one_batch]", "algorithm.overlong_buffer.len=4",
        "algorithm.filter_groups.max_num_gen_batches=2", "train.global_batch_size=1", "train.gen_batch_size=4",
    ))  # fmt: skip
    with pytest.raises(UserError) as info:
        train(cfg)
    assert "drew 2 generation batches" in info.value.problems[0]
    assert "The 1 step(s) trained so far are saved in" in info.value.problems[-1]
    saved = checkpoint.find_resume_dir(cfg)
    assert saved is not None and checkpoint.describe(saved)["step"] == 1
    sampler = torch.load(saved / "dataloader.pt", weights_only=False)["sampler"]
    assert sampler["position"] == 4  # one generation batch of 4 prompts: step 2's draws are not in it
