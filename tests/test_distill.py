"""On-policy distillation (issue 37): hand-derived loss and gradient of both variants, the tokenizer check,
and a 2-step smoke run of the loop with a teacher."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from postrl import algorithms as algo
from postrl.algorithms.distill import distill_advantages, distill_stats, topk_reverse_kl
from postrl.checks import load_config
from postrl.distill import Distiller
from postrl.held.teacher import check_tokenizer
from postrl.errors import UserError
from postrl.trainer import Trainer
from conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LN2 = math.log(2)


def _clipped(adv_BT, logp_BT, mask_BT, mode="token-mean"):
    loss_BT, _ = algo.policy_loss(logp_BT, logp_BT.detach(), adv_BT, mask_BT, clip_ratio_low=0.2, clip_ratio_high=0.28)
    return algo.aggregate_loss(loss_BT, mask_BT, mode, max_response_len=4)


def test_sampled_token_variant_loss_and_gradient_by_hand():
    """S(y) = (1/2, 1/4, 1/8), T(y) = (1/4, 1/2, 1/8); the third token is a tool token (mask 0).

    A = -(log S - log T) = (-ln 2, +ln 2, 0). On-policy the ratio is 1, so l_t = -A_t and
    token-mean over the 2 model tokens: L = (ln 2 - ln 2) / 2 = 0, dL/dlogS = -A / 2 = (ln2/2, -ln2/2, 0).
    With reward_weight 0.5 and A_group = 1: A = (0.5 - ln 2, 0.5 + ln 2), L = -(1.0) / 2 = -0.5,
    dL/dlogS = (-(0.5 - ln 2) / 2, -(0.5 + ln 2) / 2, 0)."""
    logS = torch.tensor([[math.log(1 / 2), math.log(1 / 4), math.log(1 / 8)]], requires_grad=True)
    logT = torch.tensor([[math.log(1 / 4), math.log(1 / 2), math.log(1 / 8)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    group = torch.ones(1, 3)

    adv = distill_advantages(logS.detach(), logT, group, reward_weight=0.0)
    assert torch.allclose(adv, torch.tensor([[-LN2, LN2, 0.0]]))
    loss = _clipped(adv, logS, mask)
    loss.backward()
    assert abs(float(loss.detach())) < 1e-7
    assert torch.allclose(logS.grad, torch.tensor([[LN2 / 2, -LN2 / 2, 0.0]]), atol=1e-6)

    logS.grad = None
    adv = distill_advantages(logS.detach(), logT, group, reward_weight=0.5)
    loss = _clipped(adv, logS, mask)
    loss.backward()
    assert abs(float(loss.detach()) + 0.5) < 1e-6
    assert torch.allclose(logS.grad, torch.tensor([[-(0.5 - LN2) / 2, -(0.5 + LN2) / 2, 0.0]]), atol=1e-6)

    stats = distill_stats(logS.detach(), logT, torch.tensor([[3, 5, 7]]), torch.tensor([[3, 4, 9]]), mask)
    assert abs(float(stats["distill/reverse_kl"])) < 1e-7  # (ln 2 - ln 2) / 2
    assert abs(float(stats["distill/teacher_logprob_mean"]) - (math.log(1 / 4) + math.log(1 / 2)) / 2) < 1e-6
    assert float(stats["distill/top1_agreement"]) == 0.5  # the tool token (mask 0) does not count


def test_sampled_token_gradient_through_the_logits_is_the_reinforce_estimate():
    """One position, V = 3, student logits z = (0, ln 2, 0) -> S = (1/4, 1/2, 1/4), sampled y = 1, teacher T(y) = 1/8.
    A = -(ln 1/2 - ln 1/8) = -2 ln 2; l = -A log S(y); dl/dz = -A (onehot(y) - S) = 2 ln 2 (-1/4, 1/2, -1/4)."""
    z = torch.tensor([[0.0, LN2, 0.0]], requires_grad=True)
    logp, _ = algo.token_logprobs(z, torch.tensor([1]))
    logS = logp.view(1, 1)
    adv = distill_advantages(logS.detach(), torch.tensor([[math.log(1 / 8)]]), torch.zeros(1, 1), 0.0)
    assert abs(float(adv) + 2 * LN2) < 1e-6
    _clipped(adv, logS, torch.ones(1, 1)).backward()
    assert torch.allclose(z.grad, 2 * LN2 * torch.tensor([[-0.25, 0.5, -0.25]]), atol=1e-6)


def test_topk_variant_loss_and_gradient_by_hand():
    """Student logits z = (2, 1, 0, -1); teacher top-2 ids (0, 2) with log-probs (ln 0.6, ln 0.2).

    Renormalised over K = {0, 2}: S~ = softmax(2, 0) = (e^2, 1) / (e^2 + 1), T~ = (0.75, 0.25);
    KL = sum S~ (ln S~ - ln T~); dKL/dz_v = S~_v (ln S~_v - ln T~_v - KL) on K, 0 off K.
    With temperature tau the logits are z / tau: the same formulas at z / tau, the gradient divided by tau."""
    for tau in (1.0, 2.0):
        z = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]], requires_grad=True)  # [B=1, T=1, V=4]
        ids = torch.tensor([[[0, 2]]])
        t_logp = torch.tensor([[[math.log(0.6), math.log(0.2)]]])
        kl = topk_reverse_kl(z.gather(-1, ids), t_logp, temperature=tau)
        kl.sum().backward()
        e = math.exp(2.0 / tau)
        s = (e / (e + 1), 1 / (e + 1))
        t = (0.75, 0.25)
        want = sum(si * (math.log(si) - math.log(ti)) for si, ti in zip(s, t))
        assert abs(float(kl.detach()) - want) < 1e-6
        g = [si * (math.log(si) - math.log(ti) - want) / tau for si, ti in zip(s, t)]
        assert torch.allclose(z.grad, torch.tensor([[[g[0], 0.0, g[1], 0.0]]]), atol=1e-6)
        if tau == 1.0:  # the numbers in docs/algorithms.md
            assert abs(want - 0.053306) < 1e-6 and abs(g[0] - 0.094640) < 1e-6 and abs(g[1] + 0.094640) < 1e-6


def test_topk_term_counts_loss_mask_tokens_only_in_every_mode():
    """Distiller.terms: the top-k KL is aggregated over the loss mask like the KL term; a tool token's logits get no gradient."""
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "distill.teacher_path=x", "distill.top_k=2"], check_paths=False)
    d = Distiller(cfg)
    z = torch.randn(1, 3, 5, requires_grad=True)
    ids = torch.tensor([[[0, 1], [2, 3], [4, 0]]])
    mb = {
        "teacher_logp": torch.log(torch.tensor([[0.5, 0.3, 0.2]])),
        "teacher_top1": torch.tensor([[0, 2, 4]]),
        "teacher_topk_logp": torch.log(torch.tensor([[[0.5, 0.2], [0.3, 0.3], [0.2, 0.1]]])),
        "teacher_topk_ids": ids,
        "input_ids": torch.tensor([[9, 9, 0, 2, 1]]),  # prompt (9, 9), responses (0, 2, 1)
    }
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    old = torch.log(torch.tensor([[0.4, 0.4, 0.4]]))
    adv, kl_BT, stats = d.terms(mb, old, torch.ones(1, 3), z.gather(-1, ids), mask)
    assert torch.equal(adv, torch.zeros(1, 3))  # reward_weight 0: the group advantage is off
    assert float(stats["distill/top1_agreement"]) == 0.5  # token 0 agrees, token 2 does not, token 1 is masked
    for mode in algo.LOSS_AGGREGATIONS:
        z.grad = None
        algo.aggregate_loss(kl_BT, mask, mode, max_response_len=3).backward(retain_graph=True)
        assert torch.count_nonzero(z.grad[0, 1]) == 0
        assert torch.count_nonzero(z.grad[0, 0]) > 0


# ------------------------------------------------------------------------------------------ the loop
def _copy_with_vocab_change(src, dst):
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other text
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "model.safetensors").write_bytes(b"not weights")  # loading them would fail: proves they are not read


def test_a_teacher_with_another_tokenizer_is_refused_before_any_model_loads(tmp_path, tiny_model_path, monkeypatch):
    teacher = tmp_path / "teacher"
    _copy_with_vocab_change(tiny_model_path, teacher)
    cfg = load_config(None, tiny_overrides(tmp_path, f"distill.teacher_path={teacher}"))

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the tokenizer check")

    for where in ("postrl.models.load_model", "postrl.held.reference.load_model", "postrl.assembly.load_policy"):
        monkeypatch.setattr(where, no_load)
    with pytest.raises(UserError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert "different tokenizer" in msg and "4 (token, id) pairs" in msg and "Fix:" in msg
    check_tokenizer(load_config(None, tiny_overrides(tmp_path, f"distill.teacher_path={tiny_model_path}")))  # same: passes


def _run(tmp_path, teacher, top_k, steps=1, *extra):
    cfg = load_config(None, tiny_overrides(
        tmp_path, f"distill.teacher_path={teacher}", f"distill.top_k={top_k}", "reward.verifiers=[verifiers_for_tests:length_parity]",
        *extra,
    ))  # fmt: skip
    tr = Trainer(cfg)
    try:
        return [tr.train_step() for tr.step in range(steps)]
    finally:
        tr.close()


@pytest.mark.parametrize("top_k, remove_padding", [(0, True), (3, True), (3, False)])
def test_the_student_as_its_own_teacher_gets_no_gradient(tmp_path, tiny_model_path, top_k, remove_padding):
    """S = T: the reverse KL (sampled-token estimate and top-k) is 0, every advantage 0 (reward_weight 0), so the
    gradient is exactly 0; the teacher's top-1 is the sampled token only where sampling picked it. The top-k KL is 0
    only if the student's logits are gathered at the very positions the teacher ranked (packed and padded forwards)."""
    (m,) = _run(tmp_path, tiny_model_path, top_k, 1, f"train.use_remove_padding={str(remove_padding).lower()}")
    assert abs(m["distill/reverse_kl"]) < 1e-5
    assert m["actor/grad_norm"] < 1e-6
    assert 0.0 <= m["distill/top1_agreement"] < 1.0
    assert m["distill/teacher_logprob_mean"] < 0 and m["timing/teacher"] > 0
    if top_k:
        assert abs(m["distill/topk_kl"]) < 1e-5
        assert 0 < m["distill/teacher_topk_mass"] <= 1.0 + 1e-6


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory, tiny_model_path):
    """The tiny model with noise on its weights: the same tokenizer, another distribution."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("teacher")
    shutil.copytree(tiny_model_path, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))  # the random-init model is near uniform: large noise moves it
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("top_k, extra", [(0, []), (3, []), (0, ["model.lora_rank=4"])], ids=["sampled", "topk", "lora"])
def test_two_steps_with_another_teacher(tmp_path, other_teacher, top_k, extra):
    """A different teacher: a positive reverse KL, a gradient, and two steps run (a LoRA student too: its teacher
    is its own model, not the student's base)."""
    first, second = _run(tmp_path, other_teacher, top_k, 2, *extra)
    assert first["distill/reverse_kl"] > 0.05
    assert first["actor/grad_norm"] > 0 and second["actor/grad_norm"] > 0
    if top_k:
        assert first["distill/topk_kl"] > 0


def test_topk_kl_equals_the_categorical_kl():
    """topk_reverse_kl equals KL(softmax(s_K) || softmax(t_K)) written with torch.distributions."""
    s, t = torch.randn(4, 6), torch.randn(4, 6)
    mine = topk_reverse_kl(s, torch.log_softmax(t, -1))
    ref = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=s), torch.distributions.Categorical(logits=t))
    assert torch.allclose(mine, ref, atol=1e-6)


def test_config_refuses_what_distillation_does_not_support():
    from postrl.config import build_config

    with pytest.raises(UserError) as err:
        build_config({
            "model": {"path": "m"}, "distill": {"teacher_path": "t", "top_k": 4},
            "algorithm": {"adv_estimator": "gae"}, "train": {"sequence_parallel_size": 2},
        })  # fmt: skip
    text = "\n".join(err.value.problems)
    assert "distill.teacher_path with adv_estimator 'gae'" in text and "distill.top_k (4)" in text
    cfg = build_config({"model": {"path": "m"}})
    assert not cfg.distill.enable and cfg.distill.reward_weight == 0.0 and cfg.distill.top_k == 0


def test_verl_names_of_the_distill_metrics():
    from postrl.metrics import rename_metrics

    m = {"distill/reverse_kl": 0.3, "distill/teacher_topk_mass": 0.9, "distill/top1_agreement": 0.5}
    assert rename_metrics(m, "verl", "grpo") == {
        "actor/distillation/loss": 0.3, "actor/distillation/teacher_mass": 0.9, "distill/top1_agreement": 0.5,
    }  # fmt: skip
