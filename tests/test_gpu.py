"""Training on a CUDA device: placement, fp32 equivalence with the CPU, bf16 learning, offload, sleep mode.

Every test here is marked `gpu`: skipped (and counted as skipped) where CUDA is absent, as on CI.
`benchmarks/gpu_check.py` (and gpu_session.sh) run them on a lent GPU machine; tests/test_precision.py holds the CPU
half of the precision checks (bf16 vs fp32 numerics, gradient checkpointing).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_trainer

from postrl.metrics import read_jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*optimizer.step.*:UserWarning")]


def _trainer(tmp_path, *extra: str):
    return tiny_trainer(tmp_path, "logging.sinks=[console,jsonl]", "reward.verifiers=[verifiers_for_tests:vowel_share]", *extra)


def _update_on(tr, batch) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The first update of `tr` on `batch`: (actor metrics, old log-probs on the CPU, response mask)."""
    packed = tr.actor.pack(batch, tr.experience.advantages(batch))
    old = tr.actor.compute_logprobs(tr.model, packed)
    packed.tensors["old_logp"] = old
    stats = tr.actor.update(packed)
    return stats, old.cpu(), packed.tensors["response_mask"].bool().cpu()


def test_cuda_and_cpu_give_the_same_first_step_in_float32(tmp_path):
    """The same batch (sampled once, on the CPU) through a CPU and a CUDA trainer from the same seed.

    Two PPO epochs, so the second epoch's loss depends on the weights the first step produced. fp32
    on both sides (TF32 off, torch's default for matmuls): only the order of summation differs, so
    log-probs, losses and the gradient norm agree to 1e-4.
    """
    assert not torch.backends.cuda.matmul.allow_tf32
    extra = ("train.epochs_per_batch=2", "train.lr=1e-3", "train.total_steps=1")
    cpu = _trainer(tmp_path / "cpu", "train.device=cpu", *extra)
    batch, _ = cpu.experience.collect(cpu.step, cpu.timer)
    s_cpu, old_cpu, mask = _update_on(cpu, batch)
    cpu.close()
    gpu = _trainer(tmp_path / "cuda", "train.device=cuda", *extra)
    s_gpu, old_gpu, _ = _update_on(gpu, batch)
    gpu.close()
    assert float((old_cpu - old_gpu)[mask].abs().max()) < 1e-4
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert s_gpu[key] == pytest.approx(s_cpu[key], abs=1e-4), key
    assert s_gpu["actor/grad_norm"] == pytest.approx(s_cpu["actor/grad_norm"], rel=1e-4)
    assert {p.device.type for p in gpu.model.parameters()} == {"cuda"}


def test_a_bfloat16_run_on_cuda_learns_the_dense_reward(tmp_path):
    """tests/test_trainer.py's learning test in bf16 on the GPU: the vowel share rises within 20 steps,
    and the trained weights are still fp32 masters at the end."""
    tr = _trainer(
        tmp_path, "train.device=cuda", "model.dtype=bfloat16", "train.lr=3e-3", "train.total_steps=20",
        "train.global_batch_size=8", "train.micro_batch_size=32", "rollout.n_samples_per_prompt=8",
    )  # fmt: skip
    tr.fit()
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    first = sum(r["grpo/rewards/mean"] for r in steps[:4]) / 4
    last = sum(r["grpo/rewards/mean"] for r in steps[-4:]) / 4
    assert last > first + 0.15, (first, last)
    assert {p.dtype for p in tr.model.parameters()} == {torch.float32}


def test_bfloat16_off_policy_with_a_kl_reference_on_cuda_keeps_the_guards_quiet(tmp_path):
    """bf16 on the GPU with two mini-batches (the first-ratio check is live), gradient checkpointing and
    a bf16 KL reference: the old-log-prob pass (no grad) and the update pass (grad, recomputed) agree
    within the guards' bf16 tolerance (mean gap 5e-2), the reference scores like the policy before any update
    (a rounding-sized KL), and no guard speaks."""
    tr = _trainer(
        tmp_path, "train.device=cuda", "model.dtype=bfloat16", "train.mini_batch_size=2", "algorithm.kl.coef=0.01",
        "model.gradient_checkpointing=true", "train.total_steps=2",
    )  # fmt: skip
    said = []
    tr.log = lambda msg: said.append(msg)
    tr.guards.log = tr.log
    tr.fit()
    first = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r][0]
    gaps = first["actor/first_ratio_gap_mean"], first["actor/first_ratio_gap"]  # mean (what the guard judges), largest
    assert gaps[0] <= 5e-2, gaps
    assert first["actor/kl_loss"] < 1e-3, first["actor/kl_loss"]
    assert not [m for m in said if "guard " in m], said


def test_lora_in_bfloat16_on_cuda_trains_fp32_adapters_on_a_frozen_bf16_base(tmp_path):
    """LoRA on the GPU (the 7B-on-one-GPU setting in small), with gradient checkpointing: the base stays bf16
    and frozen, the adapters train in fp32, the KL against the base (adapters off) is exactly 0 at the first
    step (one mini-batch: no update before it) and grows after, and no guard speaks. That adapters learn is
    tests/test_learning.py's (on CPU, from the SFT model)."""
    tr = _trainer(
        tmp_path, "train.device=cuda", "model.dtype=bfloat16", "model.lora_rank=16", "model.lora_alpha=32",
        "algorithm.kl.coef=0.01", "train.lr=1e-2", "model.gradient_checkpointing=true",
    )  # fmt: skip
    said = []
    tr.log = lambda msg: said.append(msg)
    tr.guards.log = tr.log
    tr.fit()
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    assert steps[0]["actor/kl_loss"] == 0.0 < steps[-1]["actor/kl_loss"]
    dtypes = {(p.requires_grad, p.dtype) for p in tr.model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    assert {p.device.type for p in tr.model.parameters()} == {"cuda"}
    assert not [m for m in said if "guard " in m], said


def test_the_offloaded_reference_stays_in_host_memory_and_scores_the_same(tmp_path):
    """train.ref_offload: the reference lives on the CPU, visits the GPU for its pass only, and its
    log-probs equal those of a reference resident on the GPU (same weights, same kernels)."""
    kl = ("train.device=cuda", "algorithm.kl.coef=0.01", "train.total_steps=1")
    resident = _trainer(tmp_path / "resident", *kl)
    batch, _ = resident.experience.collect(resident.step, resident.timer)
    packed = resident.actor.pack(batch, resident.experience.advantages(batch))
    want = resident.actor.compute_logprobs(resident.ref_model, packed)
    resident.close()
    off = _trainer(tmp_path / "offload", *kl, "train.ref_offload=true")
    assert {p.device.type for p in off.ref_model.parameters()} == {"cpu"}
    off.train_step()  # the reference pass and an update, through the trainer
    assert {p.device.type for p in off.ref_model.parameters()} == {"cpu"}
    from postrl.distributed import on_device

    packed = off.actor.pack(batch, off.experience.advantages(batch))
    with on_device(off.ref_model, off.runtime):
        got = off.actor.compute_logprobs(off.ref_model, packed)
    off.close()
    mask = packed.tensors["response_mask"].bool()
    assert float((want - got)[mask].abs().max()) < 1e-6


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_logprobs_equal_padded_on_cuda(tiny_model_path, attn):
    """train.use_remove_padding on the GPU: sdpa in fp32 (shared-prompt rows under a 4D mask) within 1e-5
    of the padded pass, as on the CPU; flash_attention_2 in bf16 (one row, varlen kernels) within bf16
    rounding of its own padded pass. Groups of 1-4 samples of prompts of 2-40 tokens, responses of 0-30."""
    import importlib.util
    import random

    from postrl.models import build_sequences, load_model, response_logprobs

    if attn.startswith("flash") and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed here")
    dtype, tol = ("float32", 1e-5) if attn == "sdpa" else ("bfloat16", 2e-2)
    model = load_model(tiny_model_path, dtype, attn_implementation=attn).cuda()
    rng, prompts, responses = random.Random(0), [], []
    for _ in range(6):
        p = [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(2, 40))]
        for _ in range(rng.randint(1, 4)):
            prompts.append(p)
            responses.append([rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(0, 30))])
    responses[0] = responses[0] or [5]
    t = {k: v.cuda() for k, v in build_sequences(prompts, responses, 0).items()}
    T, mask = t["response_mask"].shape[1], t["response_mask"].bool()
    with torch.no_grad():
        padded, packed = (
            response_logprobs(model, t["input_ids"], t["attention_mask"], t["position_ids"], T, 0.7, remove_padding=r)[0]
            for r in (False, True)
        )
    assert float((padded - packed)[mask].abs().max()) < tol


def test_seeded_hf_generation_on_cuda_repeats_and_keeps_the_run_rng(tiny_model_path):
    from postrl.models import load_model, load_tokenizer
    from postrl.rollout import SamplingParams
    from postrl.rollout.hf import HFEngine
    from postrl.runtime import init_runtime

    rt = init_runtime("cuda", "bfloat16")
    model, tok = load_model(tiny_model_path).to(rt.device), load_tokenizer(tiny_model_path)
    engine = HFEngine(model, tok, runtime=rt)
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("What is 12 + 9?")["input_ids"]]
    params = SamplingParams(n=4, max_tokens=16, seed=7)
    torch.cuda.manual_seed(99)
    before = torch.cuda.get_rng_state()
    first = [c.token_ids for c in engine.generate(prompts, params)]
    assert torch.equal(torch.cuda.get_rng_state(), before)  # the trainer's CUDA stream is untouched
    assert [c.token_ids for c in engine.generate(prompts, params)] == first


def test_vllm_sleep_and_wake_keep_seeded_generations(tiny_model_path):
    """Colocated vLLM on the GPU: sleep (level 1) during the update, wake, re-sync the same weights:
    the same seed gives the same tokens as before the sleep."""
    vllm_mod = pytest.importorskip("postrl.rollout.vllm")
    vllm_platform = pytest.importorskip("postrl.rollout.vllm_platform")
    try:
        vllm_platform.import_vllm()
    except vllm_platform.VLLMUnavailable as exc:
        pytest.skip(f"vLLM is unavailable here: {exc}")
    from postrl.config import RolloutConfig
    from postrl.models import load_model, load_tokenizer
    from postrl.rollout import SamplingParams

    model, tok = load_model(tiny_model_path).cuda(), load_tokenizer(tiny_model_path)
    engine = vllm_mod.VLLMEngine(model, tok, RolloutConfig(gpu_memory_utilization=0.3), max_model_len=256, dtype=torch.bfloat16)
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("What is 12 + 9?")["input_ids"]]
    params = SamplingParams(n=4, max_tokens=16, seed=7)
    try:
        before = [c.token_ids for c in engine.generate(prompts, params)]
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free_awake  # the KV cache and weights left the device
        engine.sync_weights(model)  # wakes the weights, reloads them
        assert [c.token_ids for c in engine.generate(prompts, params)] == before
    finally:
        engine.close()
