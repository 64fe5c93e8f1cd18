"""Foundations of async rollout (issue 24): engine capabilities, the decoupled PPO objective,
REINFORCE++ token whitening, policy versions and staleness. Numbers are derived by hand in each docstring."""

from __future__ import annotations

import pytest

from postrl.rollout import EngineCapabilities, RolloutEngine


def test_engines_declare_capabilities_and_the_protocol_requires_them():
    """HF samples with the trainer's model (no log-probs of its own, nothing to sleep); vLLM holds its own
    weights, reports sampling log-probs, can free device memory and batches continuously (the agent
    loop's turns). An engine that declares no capabilities is not a RolloutEngine."""
    from postrl.rollout.hf import HFEngine
    from postrl.rollout.vllm import VLLMEngine

    assert HFEngine.capabilities == EngineCapabilities(reports_logprobs=False, shares_trainer_model=True, can_sleep=False)
    assert VLLMEngine.capabilities == EngineCapabilities(reports_logprobs=True, shares_trainer_model=False, can_sleep=True, continuous_batching=True)
    with pytest.raises(AttributeError):  # frozen: an engine's declaration is not changed by the trainer
        HFEngine.capabilities.continuous_batching = True  # type: ignore[misc]

    class Nameless:
        name = "x"

        def generate(self, prompts, params, multi_modal=None): ...
        def generate_continuing(self, requests, on_finish, seed=None): ...
        def sync_weights(self, model): ...
        def set_threads(self, n): ...
        def pop_metrics(self): ...
        def probe_logprobs(self, token_ids): ...
        def probe_routing(self, token_ids, top_k): ...
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


# ------------------------------------------------------------------------- REINFORCE++ over tokens


def test_reinforce_plus_plus_whitens_over_tokens():
    """rewards (1, 0, 0, 1) on (3, 1, 2, 2) loss tokens, N = 8: mean (3 + 2) / 8 = 0.625, deviations
    (0.375, -0.625, -0.625, 0.375), sum of n_i d_i^2 = 3 x 0.140625 + 0.390625 + 2 x 0.390625 + 2 x 0.140625
    = 1.875, unbiased var 1.875 / 7 = 0.267857, std 0.517549 -> A = (0.724568, -1.207613, -1.207613, 0.724568).
    Per sequence (no token counts) it would be +-0.5 / 0.577351 = +-0.866024."""
    import math

    import torch

    from postrl.algorithms import get_adv_estimator

    fn = get_adv_estimator("reinforce_plus_plus")
    rewards_B, tokens_B = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([3, 1, 2, 2])
    std = math.sqrt(1.875 / 7) + 1e-6
    expected = torch.tensor([0.375, -0.625, -0.625, 0.375]) / std
    adv_B = fn(rewards_B, 2, num_tokens_B=tokens_B)
    torch.testing.assert_close(adv_B, expected)
    # the same as whitening the reward standing on every loss token (verl's masked_whiten of the returns)
    per_token = torch.repeat_interleave(rewards_B, tokens_B)
    whitened = (per_token - per_token.mean()) / (per_token.std(unbiased=True) + 1e-6)
    torch.testing.assert_close(torch.repeat_interleave(adv_B, tokens_B), whitened)
    torch.testing.assert_close(fn(rewards_B, 2), torch.tensor([0.5, -0.5, -0.5, 0.5]) / (math.sqrt(1 / 3) + 1e-6))
    torch.testing.assert_close(fn(rewards_B, 2, norm_adv_by_std=False, num_tokens_B=tokens_B), torch.tensor([0.375, -0.625, -0.625, 0.375]))
    assert torch.equal(fn(torch.full((4,), 0.3), 2, num_tokens_B=tokens_B), torch.zeros(4))  # no spread: exactly 0
    # the other estimators ignore the token counts
    for name in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_seq", "reinforce_plus_plus_baseline"):
        other = get_adv_estimator(name)
        assert torch.equal(other(rewards_B, 2, num_tokens_B=tokens_B), other(rewards_B, 2)), name
    # reinforce_plus_plus_seq counts each sequence once: rewards (1, 0, 0, 1), mean 0.5, unbiased std
    #   sqrt(4 x 0.25 / 3) = 0.577350 -> A = (0.5, -0.5, -0.5, 0.5) / 0.577351, whatever the lengths (3, 1, 2, 2)
    seq = get_adv_estimator("reinforce_plus_plus_seq")(rewards_B, 2, num_tokens_B=tokens_B)
    torch.testing.assert_close(seq, torch.tensor([0.5, -0.5, -0.5, 0.5]) / (math.sqrt(1 / 3) + 1e-6))


def test_experience_passes_each_sequences_loss_tokens_to_the_estimator(tmp_path):
    """Loss tokens, not response tokens: sequence 0 has 4 response tokens of which 3 are the model's (one tool
    token), so the counts are (3, 1, 2, 2) and the advantages those of the test above."""
    import math

    import torch
    from conftest import tiny_overrides

    from postrl.checks import load_config
    from postrl.data.dataset import PromptSampler
    from postrl.batch import Batch
    from postrl.experience import Experience

    cfg = load_config(None, tiny_overrides(tmp_path, "algorithm.adv_estimator=reinforce_plus_plus", "rollout.n_samples_per_prompt=2"))
    batch = Batch(
        prompt_ids=[[1, 2]] * 4, response_ids=[[5, 6, 7, 8], [5], [5, 6], [5, 6]],
        loss_masks=[[1, 0, 1, 1], [1], [1, 1], [1, 1]], turns=[2, 1, 1, 1], finished=[True] * 4,
        scores=[1.0, 0.0, 0.0, 1.0], rewards=[1.0, 0.0, 0.0, 1.0], verifier_metrics=[{}] * 4,
        engine_logprobs=[None] * 4, multi_modal=[None] * 4,
    )  # fmt: skip
    exp = Experience(cfg, None, None, None, [], PromptSampler(1, False, 0))
    std = math.sqrt(1.875 / 7) + 1e-6
    torch.testing.assert_close(exp.advantages(batch), torch.tensor([0.375, -0.625, -0.625, 0.375]) / std)


# ----------------------------------------------------------------------------- policy versions, staleness


def test_staleness_counts_updates_between_sampling_and_training():
    """At step 5, sequences from versions (5, 5, 3, 4) are (0, 0, 2, 1) updates old: mean 3 / 4, max 2."""
    from postrl.experience import staleness_metrics

    assert staleness_metrics([5, 5, 3, 4], 5) == {"async/staleness_mean": 0.75, "async/staleness_max": 2.0}
    assert staleness_metrics([7, 7], 7) == {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    with pytest.raises(AssertionError, match="newer than the trainer"):
        staleness_metrics([6], 5)


def test_versions_travel_with_rows_and_default_to_zero():
    """`versions` is one entry per sequence like every Batch field, so concat / select carry it generically;
    a Batch built without it (tests, tools) is from version 0."""
    from postrl.batch import Batch, concat, select

    def batch(versions=None):
        return Batch(
            prompt_ids=[[1]] * 2, response_ids=[[5], [6, 7]], loss_masks=[[1], [1, 1]], turns=[1, 1], finished=[True] * 2,
            scores=[1.0, 0.0], rewards=[1.0, 0.0], verifier_metrics=[{}] * 2, engine_logprobs=[None] * 2,
            multi_modal=[None] * 2, **({"versions": versions} if versions is not None else {}),
        )  # fmt: skip

    assert batch().versions == [0, 0]
    both = concat([batch([3, 3]), batch([4, 2])])
    assert both.versions == [3, 3, 4, 2]
    assert select(both, [3, 0]).versions == [2, 3]


def test_sync_training_stamps_the_trainers_step_and_logs_zero_staleness(tmp_path):
    """Two sync steps on the tiny model: the batch of step s was sampled by version s (the weights after s
    updates), so async/staleness_{mean,max} are 0 at both steps."""
    import json

    from conftest import tiny_overrides

    from postrl.checks import load_config
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(tmp_path, "train.total_steps=2", "rollout.max_tokens=4", "checkpoint.save_final=false"))
    tr = Trainer(cfg)
    seen = []
    collect = tr.experience.collect

    def spy(step, timer):
        batch, stats = collect(step, timer)
        seen.append((step, set(batch.versions)))
        return batch, stats

    tr.experience.collect = spy
    tr.fit()
    assert seen == [(0, {0}), (1, {1})]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_mean" in r]
    assert [(r["async/staleness_mean"], r["async/staleness_max"]) for r in steps] == [(0.0, 0.0), (0.0, 0.0)]


def test_async_keys_are_checked_and_the_decoupled_correction_is_on_by_default_off_policy():
    """sync is the default; max_staleness and partial rollout need async; async with staleness >= 1 turns the
    token-level correction (AReaL's decoupled objective) on unless the user set it; staleness 0 leaves it off."""
    from postrl.config import build_config

    m = {"model": {"path": "m"}}
    assert build_config(m).rollout.mode == "sync"
    with pytest.raises(Exception, match="max_staleness is 2.*rollout.placement: worker or pool"):
        build_config({**m, "rollout": {"max_staleness": 2}})
    with pytest.raises(Exception, match="partial_rollout.*only happen mid-generation in async mode"):
        build_config({**m, "rollout": {"partial_rollout": True}})
    with pytest.raises(Exception, match="not built for agent trajectories"):
        build_config({**m, "rollout": {"mode": "async", "partial_rollout": True, "multi_turn": {"enable": True, "tools": ["builtin:calculator"]}}})
    assert build_config({**m, "rollout": {"mode": "async"}, "cluster": {"devices_per_node": 2}}).world_size == 2  # rank 0's worker feeds both
    one_off = build_config({**m, "rollout": {"mode": "async", "max_staleness": 1}}).algorithm.rollout_correction
    assert (one_off.enable, one_off.level) == (True, "token")
    assert not build_config({**m, "rollout": {"mode": "async"}}).algorithm.rollout_correction.enable
    chosen = {"rollout_correction": {"enable": False}}
    assert not build_config({**m, "rollout": {"mode": "async", "max_staleness": 1}, "algorithm": chosen}).algorithm.rollout_correction.enable
