"""Mixture-of-experts policies (postrl.moe): the router's loss and load by hand, router replay, the tiny
Qwen3-MoE through the vLLM engine with weight sync, and a DAPO run on it."""

from __future__ import annotations

import json

import pytest
import torch

from postrl import moe
from postrl.builtin.tiny import build_tiny_model
from postrl.models import load_model


@pytest.fixture(scope="module")
def moe_path() -> str:
    return str(build_tiny_model("tiny-qwen3-moe"))


def test_load_balancing_loss_is_transformers_and_the_load_by_hand():
    """Two experts, top-1, one layer of 4 tokens: tokens 0-2 pick expert 0, token 3 expert 1: f = (3/4, 1/4).
    Router logits 0 everywhere: P = (1/2, 1/2); loss E sum f P = 2 x (3/8 + 1/8) = 1."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    experts_LNK = torch.tensor([[[0], [0], [0], [1]]])
    assert float(moe.load_balancing_loss(torch.zeros(1, 4, 2), experts_LNK)) == 1.0
    assert moe.expert_load(experts_LNK, 2).tolist() == [[0.75, 0.25]]
    # Random logits, top-2 of 4, 3 layers: the same number as transformers' (which picks the top-k itself).
    torch.manual_seed(0)
    logits_LNE = torch.randn(3, 10, 4)
    top_LNK = torch.topk(torch.softmax(logits_LNE, -1), 2, dim=-1).indices
    ours = moe.load_balancing_loss(logits_LNE, top_LNK)
    theirs = load_balancing_loss_func(tuple(logits_LNE), num_experts=4, top_k=2)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_routing_mismatch_counts_tokens_whose_expert_sets_differ():
    a = torch.tensor([[[0, 1], [2, 3], [1, 2], [0, 3]]])
    b = torch.tensor([[[1, 0], [2, 3], [1, 3], [0, 3]]])  # the same set in another order counts as equal
    assert moe.routing_mismatch(a, b) == 0.25


def test_router_replay_runs_the_forward_on_the_given_experts(moe_path):
    """Replaying the trainer's own routing changes nothing; replaying another routing makes the forward use
    exactly those experts (what the trace records) and gives other log-probs, with gradients to the router."""
    model = load_model(moe_path)
    trace = moe.RouterTrace(model)
    assert len(trace.routers) == 2 and trace.num_experts == 8
    ids = torch.tensor([[5, 17, 23, 42, 8, 99, 3, 61]])
    with torch.no_grad(), trace:
        base = model(input_ids=ids).logits
    _, own_LNK = trace.stacked()
    assert own_LNK.shape == (2, 8, 2)
    trace.replay_LNK = own_LNK
    with torch.no_grad(), trace:
        again = model(input_ids=ids).logits
    assert torch.equal(again, base)
    other_LNK = (own_LNK + 1) % 8  # every token to other experts
    trace.replay_LNK = other_LNK
    with trace:
        replayed = model(input_ids=ids).logits
    assert torch.equal(trace.stacked()[1], other_LNK) and moe.routing_mismatch(own_LNK, other_LNK) == 1.0
    assert (replayed - base).abs().max() > 1e-3
    replayed.sum().backward()
    assert trace.routers[0].weight.grad is not None and trace.routers[0].weight.grad.abs().sum() > 0


def test_vllm_engine_takes_the_trained_moe_weights(moe_path):
    """vLLM's fused MoE on CPU after a weight sync scores a sequence as the trained HF model does (to 1e-4;
    measured 5e-7). Without repack_cpu_moe the gap is 0.08: vLLM 0.32 leaves the reloaded experts unpacked."""
    import postrl.rollout.vllm_platform as vllm_platform

    try:
        vllm_platform.import_vllm()
    except vllm_platform.VLLMUnavailable as exc:  # pragma: no cover - only on machines without a working vLLM
        pytest.skip(f"vLLM is unavailable here: {exc}")
    from postrl.config import RolloutConfig
    from postrl.models import load_tokenizer, response_logprobs
    from postrl.rollout.vllm import VLLMEngine

    model, tok = load_model(moe_path), load_tokenizer(moe_path)
    engine = VLLMEngine(model, tok, RolloutConfig(kv_cache_space_gb=0.25, max_num_seqs=8, enforce_eager=True), max_model_len=64)
    try:
        probe = [5, 17, 23, 42, 8, 99, 3, 61, 12, 7]
        ids = torch.tensor([probe])

        def trainer() -> torch.Tensor:
            with torch.no_grad():
                return response_logprobs(model, ids, torch.ones_like(ids), torch.arange(len(probe))[None], len(probe) - 1)[0][0]

        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        stale = (torch.tensor(engine.probe_logprobs(probe)) - trainer()).abs().max()
        engine.sync_weights(model)
        synced = (torch.tensor(engine.probe_logprobs(probe)) - trainer()).abs().max()
        assert stale > 0.1 and synced < 1e-4, (float(stale), float(synced))
        # The engine's routing of the probe (its routers' top-2, captured in vLLM's forward) is the trainer's.
        trace = moe.RouterTrace(model)
        with torch.no_grad(), trace:
            model(input_ids=ids)
        engine_LNK = engine.probe_routing(probe, top_k=2)
        assert engine_LNK.shape == (2, len(probe), 2)
        assert moe.routing_mismatch(engine_LNK, trace.stacked()[1]) == 0.0
        # A router the engine has not received: the mismatch shows it (the weights differ, so do choices).
        with torch.no_grad():
            trace.routers[0].weight.mul_(-1.0)
            with trace:
                model(input_ids=ids)
        assert moe.routing_mismatch(engine.probe_routing(probe, top_k=2), trace.stacked()[1]) > 0.2
    finally:
        engine.close()


def test_three_dapo_steps_with_the_vllm_engine_log_the_routers(moe_path, tmp_path, capsys):
    """builtin:tiny-qwen3-moe, DAPO, vLLM rollout: the sync guard checks every step (it would stop the run),
    the start-up line says why router replay is off, and moe/* metrics (load, aux loss, the routing mismatch
    on the sync guard's probe) are logged each step."""
    import postrl.rollout.vllm_platform as vllm_platform
    from postrl.cli import main

    try:
        vllm_platform.import_vllm()
    except vllm_platform.VLLMUnavailable as exc:  # pragma: no cover
        pytest.skip(f"vLLM is unavailable here: {exc}")
    code = main([
        "train", "configs/tiny_dapo.yaml", "model.path=builtin:tiny-qwen3-moe", "rollout.engine=vllm", "rollout.enforce_eager=true",
        "rollout.kv_cache_space_gb=0.25", "train.total_steps=3", "train.global_batch_size=4", "train.gen_batch_size=4",
        "rollout.n_samples_per_prompt=4", "rollout.max_tokens=16", "algorithm.overlong_buffer.len=4",
        "algorithm.filter_groups.enable=false", "eval.before_train=false", "eval.freq=0", f"logging.dir={tmp_path}",
        "checkpoint.keep_best=null", "checkpoint.save_freq=0", "train.lr=1e-3",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "rollout engine: vllm" in out and "MoE: router replay off" in out and "guard sync" not in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "moe/aux_loss" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["moe/routing_mismatch"] == 0.0  # fp32 on both sides: the same experts for every probe token
        # 8 experts, top-2: a balanced router gives each 1/8 of the slots and an aux loss of
        # E x sum_k sum_e (1/E x 1/E) = K = 2; all on one pair of experts would give up to E = 8.
        assert 0 < r["moe/load_min"] <= 1 / 8 <= r["moe/load_max"] < 1
        assert 1.5 < r["moe/aux_loss"] < 8


def test_two_dapo_steps_of_a_tiny_qwen3_vl_moe_log_the_routers(tmp_path, capsys):
    """A random tiny Qwen3-VL-MoE (4 experts, 2 per token) on the shapes task: the routers sit in the text
    model, behind the vision tower, and are traced the same way. HF rollout: vLLM's VL code needs torchvision,
    which this CPU install lacks (docs/vision.md)."""
    from test_vision import _family_dir

    from postrl.cli import main

    path = _family_dir("qwen3_vl_moe", tmp_path / "vlmoe")
    code = main([
        "train", "configs/tiny_vl_dapo.yaml", f"model.path={path}", "rollout.engine=hf", "train.total_steps=2",
        "train.global_batch_size=2", "train.gen_batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_tokens=8",
        "algorithm.filter_groups.enable=false", "eval.before_train=false", "eval.freq=0", f"logging.dir={tmp_path / 'run'}",
        "checkpoint.keep_best=null", "checkpoint.save_freq=0", "data.shapes.train_size=16", "data.shapes.val_size=4",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "moe/aux_loss" in r]
    assert len(steps) == 2 and all(0 < r["moe/load_min"] <= 1 / 4 <= r["moe/load_max"] <= 1 for r in steps)


def test_the_load_balancing_loss_trains_the_router_under_gradient_checkpointing(moe_path):
    """The recorded router logits escape the checkpointed layers: backward still reaches the router weights."""
    model = load_model(moe_path)
    model.gradient_checkpointing_enable()
    model.train()
    trace = moe.RouterTrace(model)
    with trace:
        model(input_ids=torch.tensor([[5, 17, 23, 42, 8, 99, 3, 61]]))
    aux, stats = trace.stats()
    aux.backward()
    assert stats["moe/aux_loss"] == pytest.approx(float(aux))
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in trace.routers)
