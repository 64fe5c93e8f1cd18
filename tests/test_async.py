"""Foundations of async rollout (issue 24): engine capabilities, the decoupled PPO objective,
REINFORCE++ token whitening, policy versions and staleness. Numbers are derived by hand in each docstring."""

from __future__ import annotations

import pytest

from postrl.rollout import EngineCapabilities, RolloutEngine


def test_engines_declare_capabilities_and_the_protocol_requires_them():
    """HF samples with the trainer's model (no log-probs of its own, nothing to sleep); vLLM holds its own
    weights, reports sampling log-probs and can free device memory; neither is remote yet. An engine
    that declares no capabilities is not a RolloutEngine."""
    from postrl.rollout.hf import HFEngine
    from postrl.rollout.vllm import VLLMEngine

    assert HFEngine.capabilities == EngineCapabilities(reports_logprobs=False, shares_trainer_model=True, can_sleep=False, remote=False)
    assert VLLMEngine.capabilities == EngineCapabilities(reports_logprobs=True, shares_trainer_model=False, can_sleep=True, remote=False)
    with pytest.raises(AttributeError):  # frozen: an engine's declaration is not changed by the trainer
        HFEngine.capabilities.remote = True  # type: ignore[misc]

    class Nameless:
        name = "x"

        def generate(self, prompts, params, multi_modal=None): ...
        def sync_weights(self, model): ...
        def probe_logprobs(self, token_ids): ...
        def sleep(self): ...
        def close(self): ...

    assert not isinstance(Nameless(), RolloutEngine)
    Nameless.capabilities = HFEngine.capabilities
    assert isinstance(Nameless(), RolloutEngine)


# ------------------------------------------------------------------ the decoupled PPO objective (AReaL)


def test_decoupled_ppo_objective_is_vanilla_times_the_token_correction():
    """AReaL's decoupled objective (DESIGN.md section 10), by hand, with behaviour q (engine), proximal
    p_prox (the trainer's old log-probs) and current p; eps_low 0.2, eps_high 0.28, cap 3:

        l_t = w_t x max(-A r_t, -A clip(r_t, 0.8, 1.28)),  r_t = p / p_prox,  w_t = min(p_prox / q, 3)

    token  A   q    p_prox  p     r    w                  surrogate           l      dl/dlogp = -A r w (unclipped only)
    1      1   .25  .5      .55   1.1  2                  max(-1.1, -1.1)     -2.2   -2.2
    2      1   .1   .4      .6    1.5  4 -> 3 (capped)    max(-1.5, -1.28)    -3.84  0 (clipped)
    3     -1   .5   .5      .3    .6   1 (staleness 0)    max(.6, .8)         0.8    0 (clipped)
    4     -1   .4   .2      .3    1.5  .5                 max(1.5, 1.28)      0.75   0.75

    postrl computes it as `policy_loss: vanilla` weighted by `rollout_correction.level: token` with the
    cap as AReaL's behav_imp_weight_cap (the actor passes its old log-probs, i.e. p_prox, to both)."""
    import math

    import torch

    from postrl.algorithms import get_policy_loss_fn, rollout_correction

    F64 = torch.float64
    q = torch.tensor([[0.25, 0.1, 0.5, 0.4]], dtype=F64).log()
    p_prox = torch.tensor([[0.5, 0.4, 0.5, 0.2]], dtype=F64).log()
    p = torch.tensor([[0.55, 0.6, 0.3, 0.3]], dtype=F64).log().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=F64)

    pg_BT, _ = get_policy_loss_fn("vanilla")(p, p_prox, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    w_BT, stats = rollout_correction(p_prox, q, mask, level="token", cap=3.0)
    loss_BT = pg_BT * w_BT
    torch.testing.assert_close(w_BT, torch.tensor([[2.0, 3.0, 1.0, 0.5]], dtype=F64))
    torch.testing.assert_close(loss_BT.detach(), torch.tensor([[-2.2, -3.84, 0.8, 0.75]], dtype=F64))
    loss_BT.sum().backward()
    torch.testing.assert_close(p.grad, torch.tensor([[-2.2, 0.0, 0.0, 0.75]], dtype=F64))
    assert not w_BT.requires_grad  # w is data: no gradient reaches q or p_prox through it
    # AReaL logs behave_imp_weight; here the same numbers are rollout_corr/weight_{mean,max}: mean 6.5 / 4, max 3
    assert math.isclose(float(stats["rollout_corr/weight_mean"]), 6.5 / 4) and float(stats["rollout_corr/weight_max"]) == 3.0
    assert math.isclose(float(stats["rollout_corr/capped_frac"]), 0.25)

    # staleness 0 (q == p_prox): w = 1 everywhere and the objective is today's vanilla loss
    w0_BT, _ = rollout_correction(p_prox, p_prox, mask, level="token", cap=3.0)
    torch.testing.assert_close(pg_BT * w0_BT, pg_BT)
