"""Hand-derived numbers for every formula of docs/algorithms.md (src/postrl/algorithms/).

Each expected value carries its derivation in a comment, so a failing test says which formula moved.
Ratios are written as ratios: logp = ln r with logp_old = 0, so r = exp(logp - logp_old) exactly.
The last section checks the property the aggregation split exists for: the gradient of a mini-batch
does not depend on how it is cut into micro-batches, for every loss_agg_mode.
"""

from __future__ import annotations

import math

import pytest
import torch

from postrl.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    aggregate_loss,
    cispo_policy_loss,
    drgrpo_advantages,
    entropy_from_logits,
    get_adv_estimator,
    get_policy_loss_fn,
    grpo_advantages,
    group_keep_mask,
    gspo_policy_loss,
    kl_penalty,
    loss_normalizers,
    overlong_penalty,
    policy_loss,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    rollout_correction,
    token_logprobs,
)

F64 = torch.float64
LOSS_AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def single_token_loss(ratio: float, adv: float, clip_ratio_c: float | None = None) -> float:
    """Per-token loss of one token with ratio r and advantage A, eps_low 0.2, eps_high 0.28."""
    loss_BT, _ = policy_loss(
        t([[math.log(ratio)]]), t([[0.0]]), t([[adv]]), t([[1.0]]),
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c,
    )
    return loss_BT.item()


# ------------------------------------------------------------------------------------- advantages


def test_grpo_advantages_unbiased_std_with_epsilon():
    rewards_B = t([1, 0, 0, 0, 1, 1, 0, 0])
    adv_B = grpo_advantages(rewards_B, group_size=4)
    # group 0: mean 0.25, deviations (0.75, -0.25, -0.25, -0.25), sum of squares 0.75,
    #   unbiased var 0.75 / 3 = 0.25, std 0.5 -> A = 0.75 / (0.5 + 1e-6) = 1.499997, -0.25 / 0.500001 = -0.499999
    #   (the biased std 0.4330 would give 1.7321: this pins n - 1)
    # group 1: mean 0.5, deviations +-0.5, unbiased var 1 / 3, std 0.577350 -> A = +-0.5 / 0.577351 = +-0.866024
    expected = [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001]
    expected += [0.5 / (math.sqrt(1 / 3) + 1e-6)] * 2 + [-0.5 / (math.sqrt(1 / 3) + 1e-6)] * 2
    close(adv_B, expected)
    assert adv_B[0].item() != pytest.approx(1.5, abs=1e-7), "epsilon 1e-6 must be added to the std"


def test_grpo_advantages_epsilon_is_added_to_std_not_variance():
    # group 0 as above, std 0.5; epsilon 0.5 -> A = 0.75 / (0.5 + 0.5) = 0.75, -0.25 / 1.0 = -0.25
    adv_B = grpo_advantages(t([1, 0, 0, 0]), group_size=4, epsilon=0.5)
    close(adv_B, [0.75, -0.25, -0.25, -0.25])


def test_grpo_advantages_dr_grpo_only_centres():
    # Dr. GRPO: A = R - mean. group 0 mean 0.25, group 1 mean 0.5, group 2 mean 2 (std 2 would not matter)
    adv_B = grpo_advantages(t([1, 0, 0, 0, 1, 1, 0, 0, 0, 4, 2, 2]), group_size=4, norm_adv_by_std=False)
    close(adv_B, [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, -2.0, 2.0, 0.0, 0.0])


def test_grpo_advantages_zero_variance_group_gives_zero():
    # all-equal group: R - mean = 0 and std = 0 -> 0 / (0 + 1e-6) = 0 (no nan); the mixed group is unaffected
    adv_B = grpo_advantages(t([1, 1, 0, 0, 1, 0]), group_size=2)
    # groups (1,1) -> 0, 0; (0,0) -> 0, 0; (1,0): mean 0.5, unbiased std sqrt(0.5) = 0.707107 -> +-0.707106
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv_B, [0.0, 0.0, 0.0, 0.0, a, -a])
    assert torch.isfinite(adv_B).all()
    close(grpo_advantages(t([3.0, 3.0]), group_size=2, norm_adv_by_std=False), [0.0, 0.0])


def test_grpo_advantages_shape_order_and_token_broadcast():
    # prompt-major: one advantage per sequence, in input order, and groups do not mix
    rewards_B = torch.tensor([0, 1, 5, 7])  # integer rewards are accepted
    adv_B = grpo_advantages(rewards_B, group_size=2, norm_adv_by_std=False)
    assert adv_B.shape == (4,)
    close(adv_B.double(), [-0.5, 0.5, -1.0, 1.0])
    # A_i is broadcast to every response token of sequence i
    mask_BT = torch.ones(4, 3)
    adv_BT = adv_B[:, None].expand_as(mask_BT)
    assert adv_BT.shape == (4, 3)
    close(adv_BT.double(), [[-0.5] * 3, [0.5] * 3, [-1.0] * 3, [1.0] * 3])


def test_grpo_advantages_rejects_bad_group_size():
    with pytest.raises(AssertionError):
        grpo_advantages(t([1.0, 0.0]), group_size=1)
    with pytest.raises(AssertionError):
        grpo_advantages(t([1.0, 0.0, 1.0]), group_size=2)


# A reward that float32 cannot represent: the mean of three copies is not the value itself, so a
# naive R - mean(R) leaves a rounding error that the std division blows up (~0.03 for GRPO).
NON_REPRESENTABLE = 0.48918265


def test_non_representable_uniform_reward_really_leaves_a_rounding_error():
    # guard for the tests below: the naive float32 computation is not 0 on this input
    rewards_BG = torch.tensor([[NON_REPRESENTABLE] * 3])
    centered_BG = rewards_BG - rewards_BG.mean(dim=1, keepdim=True)
    assert centered_BG.abs().max() > 0
    assert (centered_BG / (rewards_BG.std(dim=1, keepdim=True) + 1e-6)).abs().max() > 0.01


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_seq", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_uniform_groups_give_exactly_zero_advantage(name, norm_adv_by_std):
    fn = get_adv_estimator(name)
    for group_size in (2, 3, 5):
        rewards_B = torch.full((2 * group_size,), NON_REPRESENTABLE)  # float32, two uniform groups
        adv_B = fn(rewards_B, group_size, norm_adv_by_std=norm_adv_by_std)
        assert adv_B.dtype == torch.float32 and adv_B.shape == (2 * group_size,)
        assert torch.equal(adv_B, torch.zeros(2 * group_size)), (name, group_size, adv_B)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_uniform_group_is_zero_next_to_a_mixed_group(name):
    # group 0 is uniform at a non-representable value, group 1 = (0, 1, 1) has spread
    rewards_B = torch.tensor([NON_REPRESENTABLE] * 3 + [0.0, 1.0, 1.0])
    adv_B = get_adv_estimator(name)(rewards_B, 3)
    assert torch.equal(adv_B[:3], torch.zeros(3))
    if name == "reinforce_plus_plus_baseline":
        # R' = (0, 0, 0, -2/3, 1/3, 1/3): batch mean 0, sum of squares 6/9, unbiased var (2/3) / 5 = 2/15,
        #   std 0.365148 -> A = R' / 0.365149 = (-1.825737, 0.912868, 0.912868)
        close(adv_B[3:].double(), [(-2 / 3) / (math.sqrt(2 / 15) + 1e-6), (1 / 3) / (math.sqrt(2 / 15) + 1e-6)] + [
            (1 / 3) / (math.sqrt(2 / 15) + 1e-6)])
    else:
        # the mixed group is untouched: the same advantages as when it stands alone
        assert torch.equal(adv_B[3:], get_adv_estimator(name)(rewards_B[3:], 3))


def test_drgrpo_centres_and_ignores_norm_flag():
    # group 0: mean 0.25 -> 0.75, -0.25 x 3; group 1 (0, 4, 2, 2): mean 2 -> -2, 2, 0, 0 (std 1.63 is not used)
    rewards_B = t([1, 0, 0, 0, 0, 4, 2, 2])
    expected = [0.75, -0.25, -0.25, -0.25, -2.0, 2.0, 0.0, 0.0]
    close(drgrpo_advantages(rewards_B, 4).double(), expected)
    close(drgrpo_advantages(rewards_B, 4, norm_adv_by_std=True, epsilon=0.5).double(), expected)


def test_rloo_leave_one_out_baseline():
    # group 0 (1, 0, 0, 0): A_0 = 1 - (0 + 0 + 0) / 3 = 1; A_j = 0 - (1 + 0 + 0) / 3 = -1/3
    # group 1 (0, 4, 2, 2): A_0 = 0 - 8/3 = -2.666667; A_1 = 4 - 4/3 = 2.666667; A_2 = 2 - 6/3 = 0; A_3 = 0
    #   (= G / (G - 1) x (R - mean): 4/3 x (-2, 2, 0, 0); GRPO's Dr. variant would give -2, 2, 0, 0)
    adv_B = rloo_advantages(t([1, 0, 0, 0, 0, 4, 2, 2]), 4)
    close(adv_B.double(), [1.0, -1 / 3, -1 / 3, -1 / 3, -8 / 3, 8 / 3, 0.0, 0.0])
    # G = 2: (1, 0) -> 1 - 0 = 1, 0 - 1 = -1 (twice Dr. GRPO's +-0.5); norm_adv_by_std is ignored
    close(rloo_advantages(t([1, 0]), 2, norm_adv_by_std=True).double(), [1.0, -1.0])
    with pytest.raises(AssertionError):
        rloo_advantages(t([1.0, 0.0, 1.0]), 2)


def test_reinforce_plus_plus_normalises_over_the_whole_batch():
    # rewards (1, 1 | 0, 1), groups ignored: mean 0.75, deviations (0.25, 0.25, -0.75, 0.25),
    #   sum of squares 3 x 0.0625 + 0.5625 = 0.75, unbiased var 0.75 / 3 = 0.25, std 0.5
    #   -> A = (0.25, 0.25, -0.75, 0.25) / 0.500001 = (0.499999, 0.499999, -1.499997, 0.499999)
    # the uniform group (1, 1) gets a non-zero advantage: there are no groups (GRPO would give 0, 0)
    adv_B = reinforce_plus_plus_advantages(t([1, 1, 0, 1]), 2)
    close(adv_B.double(), [0.25 / 0.500001, 0.25 / 0.500001, -0.75 / 0.500001, 0.25 / 0.500001])
    # the same with any group size: 4 or 1 changes nothing
    assert torch.equal(reinforce_plus_plus_advantages(t([1, 1, 0, 1]), 4), adv_B)
    # norm_adv_by_std=False only centres: (0.25, 0.25, -0.75, 0.25)
    close(reinforce_plus_plus_advantages(t([1, 1, 0, 1]), 2, norm_adv_by_std=False).double(), [0.25, 0.25, -0.75, 0.25])


def test_reinforce_plus_plus_baseline_group_mean_then_batch_std():
    # rewards (1, 1 | 0, 1): R' = R - group mean = (0, 0 | -0.5, 0.5); batch std of R': mean 0,
    #   sum of squares 0.5, unbiased var 0.5 / 3 = 1/6, std 0.408248 -> A = +-0.5 / 0.408249 = +-1.224742
    #   (GRPO's group std would give +-0.5 / 0.707108 = +-0.707106; REINFORCE++ would not zero group 0)
    adv_B = reinforce_plus_plus_baseline_advantages(t([1, 1, 0, 1]), 2)
    a = 0.5 / (math.sqrt(1 / 6) + 1e-6)
    close(adv_B.double(), [0.0, 0.0, -a, a])
    close(reinforce_plus_plus_baseline_advantages(t([1, 1, 0, 1]), 2, norm_adv_by_std=False).double(),
          [0.0, 0.0, -0.5, 0.5])


def test_estimator_registry_by_name():
    assert sorted(ADV_ESTIMATORS) == sorted(
        ["grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_seq", "reinforce_plus_plus_baseline"]
    )
    assert get_adv_estimator("grpo") is grpo_advantages and get_adv_estimator("rloo") is rloo_advantages
    # every estimator takes the common signature: rewards, group size, keyword norm flag and epsilon
    for name, fn in ADV_ESTIMATORS.items():
        adv_B = fn(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, norm_adv_by_std=True, epsilon=1e-6)
        assert adv_B.shape == (4,) and adv_B.dtype == torch.float32, name
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'") as excinfo:
        get_adv_estimator("gae")
    for name in ADV_ESTIMATORS:
        assert name in str(excinfo.value)


# ------------------------------------------------------------------------------------ policy loss


def test_policy_loss_inside_clip_range_is_minus_a_times_ratio():
    # r = e^0.1 = 1.105171 in [0.8, 1.28]: A = +1 -> -1.105171; A = -1 -> +1.105171; A = 2 -> -2.210342
    assert single_token_loss(math.exp(0.1), +1.0) == pytest.approx(-1.105171, abs=1e-6)
    assert single_token_loss(math.exp(0.1), -1.0) == pytest.approx(1.105171, abs=1e-6)
    assert single_token_loss(math.exp(0.1), 2.0) == pytest.approx(-2.210342, abs=1e-6)


def test_policy_loss_clip_higher_positive_advantage():
    # A = +1, upper side: r = e^0.5 = 1.648721, clipped at 1 + eps_high = 1.28 -> max(-1.6487, -1.28) = -1.28
    assert single_token_loss(math.exp(0.5), +1.0) == pytest.approx(-1.28, abs=1e-9)
    # A = +1, r = 1.25: inside 1.28 (clip-higher), so NOT clipped to 1.2 -> -1.25
    assert single_token_loss(1.25, +1.0) == pytest.approx(-1.25, abs=1e-9)
    # A = +1, lower side: r = 0.75, clip gives 0.8 -> max(-0.75, -0.8) = -0.75 (pessimistic: no clip for A > 0 here)
    assert single_token_loss(0.75, +1.0) == pytest.approx(-0.75, abs=1e-9)
    # A = +1, r = e^-0.5 = 0.606531 -> max(-0.6065, -0.8) = -0.606531
    assert single_token_loss(math.exp(-0.5), +1.0) == pytest.approx(-0.606531, abs=1e-6)


def test_policy_loss_clip_higher_negative_advantage():
    # A = -1, lower side: r = 0.75 clipped at 1 - eps_low = 0.8 -> max(0.75, 0.8) = 0.8
    #   (with eps_high used on the low side, 1 - 0.28 = 0.72, it would stay 0.75: this pins eps_low)
    assert single_token_loss(0.75, -1.0) == pytest.approx(0.8, abs=1e-9)
    # A = -1, r = e^-0.5 = 0.6065 -> max(0.6065, 0.8) = 0.8
    assert single_token_loss(math.exp(-0.5), -1.0) == pytest.approx(0.8, abs=1e-9)
    # A = -1, upper side: r = 1.5, clip gives 1.28 -> max(1.5, 1.28) = 1.5 (pessimistic: unclipped for A < 0)
    assert single_token_loss(1.5, -1.0) == pytest.approx(1.5, abs=1e-9)
    # A = -2, r = 0.5 -> max(2 * 0.5, 2 * 0.8) = 1.6
    assert single_token_loss(0.5, -2.0) == pytest.approx(1.6, abs=1e-9)


def test_policy_loss_clipped_tokens_have_zero_gradient():
    # d l / d logp = -A r when the unclipped term is active, 0 when the clipped term is active
    ratio_T = t([1.1, 1.5, 0.75, 0.75])
    adv_T = t([1.0, 1.0, 1.0, -1.0])
    logp_BT = ratio_T.log()[None].requires_grad_(True)
    loss_BT, _ = policy_loss(logp_BT, torch.zeros(1, 4, dtype=F64), adv_T[None], torch.ones(1, 4),
                             clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss_BT.sum().backward()
    # r=1.1 A=+1: -1.1; r=1.5 A=+1 clipped: 0; r=0.75 A=+1 unclipped: -0.75; r=0.75 A=-1 clipped at 0.8: 0
    close(logp_BT.grad, [[-1.1, 0.0, -0.75, 0.0]])


def test_policy_loss_dual_clip_bounds_negative_advantage():
    # A = -1, r = 5: clip-higher gives max(5, 1.28) = 5; dual clip c = 3 -> min(5, -A c = 3) = 3
    assert single_token_loss(5.0, -1.0, clip_ratio_c=3.0) == pytest.approx(3.0, abs=1e-9)
    # A = -2, r = 5: max(10, 2.56) = 10 -> min(10, 2 * 3 = 6) = 6
    assert single_token_loss(5.0, -2.0, clip_ratio_c=3.0) == pytest.approx(6.0, abs=1e-9)
    # A = -1, r = 1.5 < c: min(1.5, 3) = 1.5 (dual clip inactive)
    assert single_token_loss(1.5, -1.0, clip_ratio_c=3.0) == pytest.approx(1.5, abs=1e-9)
    # c = None disables it: A = -1, r = 5 -> 5
    assert single_token_loss(5.0, -1.0, clip_ratio_c=None) == pytest.approx(5.0, abs=1e-9)
    # dual clip never touches A > 0: r = 5, A = +1 -> max(-5, -1.28) = -1.28 with or without c
    assert single_token_loss(5.0, +1.0, clip_ratio_c=3.0) == pytest.approx(-1.28, abs=1e-9)
    with pytest.raises(AssertionError, match="clip_ratio_c"):
        single_token_loss(5.0, -1.0, clip_ratio_c=1.0)


def test_policy_loss_ratio_clamped_at_20_stays_finite():
    # logp - logp_old = +-1000 -> clamped to +-20: r = e^20 = 4.851652e8 or e^-20 = 2.061154e-9
    logp_BT = t([[0.0, 0.0, -1000.0, -1000.0]]).requires_grad_(True)
    old_logp_BT = t([[-1000.0, -1000.0, 0.0, 0.0]])
    adv_BT = t([[1.0, -1.0, 1.0, -1.0]])
    mask_BT = torch.ones(1, 4)
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)

    loss_BT, stats = policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, clip_ratio_c=None, **kwargs)
    # r = e^20, A = +1: max(-4.85e8, -1.28) = -1.28;  r = e^20, A = -1, no dual clip: max(4.85e8, 1.28) = e^20
    # r = e^-20, A = +1: max(-2.06e-9, -0.8) = -2.06e-9;  r = e^-20, A = -1: max(2.06e-9, 0.8) = 0.8
    close(loss_BT, [[-1.28, math.exp(20.0), -math.exp(-20.0), 0.8]], atol=1e-3)
    assert loss_BT[0, 1].item() == pytest.approx(math.exp(20.0), rel=1e-12)
    # ppo_kl = mean(-log r) over the clamped log-ratios: (-20 - 20 + 20 + 20) / 4 = 0
    close(stats["ppo_kl"], 0.0)

    loss_BT, stats = policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, clip_ratio_c=3.0, **kwargs)
    # dual clip: r = e^20, A = -1 -> min(e^20, 3) = 3
    close(loss_BT, [[-1.28, 3.0, -math.exp(-20.0), 0.8]])
    loss_BT.sum().backward()
    assert all(torch.isfinite(v).all() for v in (loss_BT, logp_BT.grad, *stats.values()))


def test_policy_loss_stats_on_masked_batch():
    # Row 0: A = +1, r = (1.5, 1.1, 0.5), all valid. Row 1: A = -1, r = (5, 0.5, 10), last token masked.
    ratio_BT = t([[1.5, 1.1, 0.5], [5.0, 0.5, 10.0]])
    adv_BT = t([[1.0] * 3, [-1.0] * 3])
    mask_BT = t([[1, 1, 1], [1, 1, 0]])
    loss_BT, stats = policy_loss(ratio_BT.log(), torch.zeros(2, 3, dtype=F64), adv_BT, mask_BT,
                                 clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    # (0,0) r 1.5 A+1: max(-1.5, -1.28) = -1.28, clipped term active
    # (0,1) r 1.1 A+1: -1.1, both terms equal -> not counted as clipped
    # (0,2) r 0.5 A+1: max(-0.5, -0.8) = -0.5, not clipped
    # (1,0) r 5 A-1: max(5, 1.28) = 5 (not clipped), dual clip min(5, 3) = 3 -> lower active
    # (1,1) r 0.5 A-1: max(0.5, 0.8) = 0.8, clipped term active; 0.8 < 3
    # (1,2) masked, r 10 A-1: min(10, 3) = 3 (lower active but ignored by the stats)
    close(loss_BT, [[-1.28, -1.1, -0.5], [3.0, 0.8, 3.0]])
    # pg_clipfrac = 2 of 5 valid tokens = 0.4 (2 / 6 = 0.333 if the mask were ignored)
    close(stats["pg_clipfrac"], 0.4)
    # pg_clipfrac_lower = 1 of 5 = 0.2 (2 / 6 if the mask were ignored)
    close(stats["pg_clipfrac_lower"], 0.2)
    # ppo_kl = mean(logp_old - logp) = -(ln 1.5 + ln 1.1 + ln 0.5 + ln 5 + ln 0.5) / 5 = -ln(2.0625) / 5 = -0.144784
    close(stats["ppo_kl"], -math.log(2.0625) / 5)
    assert all(not v.requires_grad for v in stats.values())


# ------------------------------------------------------------------------------- GSPO, CISPO, registry


def test_policy_loss_registry_by_name():
    assert sorted(POLICY_LOSSES) == ["cispo", "clip_cov", "geo_mean", "gpg", "gspo", "kl_cov", "sapo", "vanilla"]
    assert get_policy_loss_fn("vanilla") is policy_loss  # `policy_loss` stays the name of the vanilla loss
    assert get_policy_loss_fn("gspo") is gspo_policy_loss and get_policy_loss_fn("cispo") is cispo_policy_loss
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'") as excinfo:
        get_policy_loss_fn("ppo")
    for name in POLICY_LOSSES:
        assert name in str(excinfo.value)


# one sequence of three tokens, the last masked: logp - logp_old = (0.1, 0.3, 5.0)
GSPO_LOG_RATIO_BT = [[0.1, 0.3, 5.0]]
GSPO_MASK_BT = [[1, 1, 0]]
PAPER_EPS = dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4)


def gspo(log_ratio_BT, adv: float, mask_BT=GSPO_MASK_BT, **eps):
    logp_BT = t(log_ratio_BT).requires_grad_(True)
    adv_BT = torch.full_like(logp_BT, adv)
    loss_BT, stats = gspo_policy_loss(logp_BT, torch.zeros_like(logp_BT), adv_BT, t(mask_BT), **eps)
    (loss_BT * t(mask_BT)).sum().backward()
    return loss_BT.detach(), logp_BT.grad, stats


def test_gspo_sequence_ratio_is_the_geometric_mean_over_valid_tokens():
    # s = exp((0.1 + 0.3) / 2) = e^0.2 = 1.221403 (the masked 5.0 does not count: with it, e^1.8 = 6.05);
    # the per-token ratios' mean (e^0.1 + e^0.3) / 2 = 1.227507 would be the token-level view.
    # eps 0.2 / 0.28: 1.2214 < 1.28, so A = -1 -> l = +1.221403 on every token, A = +1 -> -1.221403
    s = math.exp(0.2)
    loss_BT, grad_BT, stats = gspo(GSPO_LOG_RATIO_BT, -1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(loss_BT, [[s, s, s]])
    # d l_t / d logp_t = -A s_i = s (each token's gradient carries the whole sequence's ratio, not s / |y|)
    close(grad_BT, [[s, s, 0.0]])
    close(stats["pg_clipfrac"], 0.0)
    # ppo_kl = mean over valid tokens of (logp_old - logp) = -(0.1 + 0.3) / 2 = -0.2
    close(stats["ppo_kl"], -0.2)
    loss_BT, grad_BT, _ = gspo(GSPO_LOG_RATIO_BT, +1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(loss_BT, [[-s, -s, -s]])
    close(grad_BT, [[-s, -s, 0.0]])


def test_gspo_paper_clip_range_clips_whole_sequences():
    s = math.exp(0.2)  # 1.221403, far outside [1 - 3e-4, 1 + 4e-4] = [0.9997, 1.0004]
    # A = +1: max(-1.221403, -1.0004) = -1.0004, clipped: no gradient, both valid tokens count as clipped
    loss_BT, grad_BT, stats = gspo(GSPO_LOG_RATIO_BT, +1.0, **PAPER_EPS)
    close(loss_BT, [[-1.0004] * 3])
    close(grad_BT, [[0.0, 0.0, 0.0]])
    close(stats["pg_clipfrac"], 1.0)
    assert stats["pg_clipfrac_lower"].item() == 0.0
    # A = -1: max(1.221403, 1.0004) = 1.221403, pessimistic side: not clipped, gradient s
    loss_BT, grad_BT, stats = gspo(GSPO_LOG_RATIO_BT, -1.0, **PAPER_EPS)
    close(loss_BT, [[s] * 3])
    close(grad_BT, [[s, s, 0.0]])
    close(stats["pg_clipfrac"], 0.0)
    # lower side, log-ratios (-0.1, -0.3): s = e^-0.2 = 0.818731
    #   A = -1: max(0.818731, 0.9997) = 0.9997, clipped; A = +1: max(-0.818731, -0.9997) = -0.818731
    loss_BT, grad_BT, stats = gspo([[-0.1, -0.3, 0.0]], -1.0, **PAPER_EPS)
    close(loss_BT, [[0.9997] * 3])
    close(grad_BT, [[0.0, 0.0, 0.0]])
    close(stats["pg_clipfrac"], 1.0)
    loss_BT, _, _ = gspo([[-0.1, -0.3, 0.0]], +1.0, **PAPER_EPS)
    close(loss_BT, [[-math.exp(-0.2)] * 3])


def test_gspo_loss_is_not_bounded_by_the_clip_range_for_negative_advantages():
    # log-ratios (1, 3 | masked): s = exp((1 + 3) / 2) = e^2 = 7.389056, far above 1 + 4e-4.
    # A = -1: max(-A s, -A clip(s)) = max(7.389056, 1.0004) = 7.389056: the unclipped term wins, so the
    # loss grows with s and the gradient -A s = 7.389056 flows; GSPO has no dual clip to cap it at -A c.
    s = math.exp(2.0)
    loss_BT, grad_BT, stats = gspo([[1.0, 3.0, 0.0]], -1.0, **PAPER_EPS)
    close(loss_BT, [[s] * 3], atol=1e-9)
    close(grad_BT, [[s, s, 0.0]], atol=1e-9)
    close(stats["pg_clipfrac"], 0.0)
    # vanilla with dual clip c = 3 bounds the same tokens (r = e, e^3) at -A c = 3
    loss_BT, _ = policy_loss(t([[1.0, 3.0]]), t([[0.0, 0.0]]), t([[-1.0, -1.0]]), t([[1.0, 1.0]]),
                             clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=3.0)  # fmt: skip
    close(loss_BT, [[math.e, 3.0]], atol=1e-9)


def test_gspo_ratio_per_sequence_and_dual_clip_ignored():
    # row 0: log-ratios (0.1, 0.3 | masked) -> s = e^0.2; row 1: (0.6, 0.0, -0.3), all valid -> s = e^0.1
    # A = -1 everywhere, eps 0.2 / 0.28, c = 1.1 (would bind for vanilla at r > 1.1; GSPO ignores it)
    logp_BT = t([[0.1, 0.3, 0.0], [0.6, 0.0, -0.3]])
    mask_BT = t([[1, 1, 0], [1, 1, 1]])
    loss_BT, stats = gspo_policy_loss(logp_BT, torch.zeros(2, 3, dtype=F64), -torch.ones(2, 3, dtype=F64), mask_BT,
                                      clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.1)
    close(loss_BT, [[math.exp(0.2)] * 3, [math.exp(0.1)] * 3])
    assert stats["pg_clipfrac_lower"].item() == 0.0
    # a log-ratio of 1000 on a valid token: the mean is clamped at 20, the loss stays finite
    loss_BT, _ = gspo_policy_loss(t([[1000.0]]), t([[0.0]]), t([[-1.0]]), t([[1.0]]), **PAPER_EPS)
    close(loss_BT, [[math.exp(20.0)]], atol=1e-3)


def cispo_case():
    # (p, p_old, A): r = 0.5 / 0.25 = 2, A = +1; r = 0.2 / 0.4 = 0.5, A = -1; r = 0.55 / 0.5 = 1.1, A = +2
    logp_BT = t([[math.log(0.5), math.log(0.2), math.log(0.55)]]).requires_grad_(True)
    old_logp_BT = t([[math.log(0.25), math.log(0.4), math.log(0.5)]])
    adv_BT = t([[1.0, -1.0, 2.0]])
    return logp_BT, old_logp_BT, adv_BT, torch.ones(1, 3)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    logp_BT, old_logp_BT, adv_BT, mask_BT = cispo_case()
    loss_BT, stats = cispo_policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # w = sg(clip(r, 0.8, 1.28)) = (1.28, 0.8, 1.1); l = -w A logp:
    #   -1.28 x 1 x ln 0.5 = 0.887228;  -0.8 x (-1) x ln 0.2 = -1.287550;  -1.1 x 2 x ln 0.55 = 1.315241
    close(loss_BT, [[-1.28 * math.log(0.5), 0.8 * math.log(0.2), -2.2 * math.log(0.55)]])
    loss_BT.sum().backward()
    # gradient -w A: (-1.28, 0.8, -2.2); the first token is clipped (r = 2 > 1.28) yet still learns
    close(logp_BT.grad, [[-1.28, 0.8, -2.2]])
    # weights truncated on tokens 1 (2 > 1.28) and 2 (0.5 < 0.8): 2 of 3
    close(stats["pg_clipfrac"], 2 / 3)
    assert stats["pg_clipfrac_lower"].item() == 0.0
    # vanilla PPO on the same tokens: r = 2 with A = +1 and r = 0.5 with A = -1 are clipped -> zero gradient
    logp_BT, old_logp_BT, adv_BT, mask_BT = cispo_case()
    loss_BT, _ = policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss_BT.sum().backward()
    close(logp_BT.grad, [[0.0, 0.0, -2.2]])  # -A r = -2 x 1.1 on the third token


def test_cispo_on_policy_gradient_equals_vanilla():
    # at r = 1 the weight is 1: d(-A logp) = -A = d(-A r) for PPO (d r / d logp = r = 1)
    gen = torch.Generator().manual_seed(3)
    logp0_BT = -torch.rand(3, 5, generator=gen, dtype=F64) * 3
    adv_BT = torch.randn(3, 1, generator=gen, dtype=F64).expand(3, 5)
    grads = []
    for fn in (policy_loss, cispo_policy_loss):
        logp_BT = logp0_BT.clone().requires_grad_(True)
        loss_BT, _ = fn(logp_BT, logp0_BT, adv_BT, torch.ones(3, 5), clip_ratio_low=0.2, clip_ratio_high=0.28)
        loss_BT.sum().backward()
        grads.append(logp_BT.grad)
    close(grads[1], grads[0])
    close(grads[0], -adv_BT)


# ----------------------------------------------------------------------------- rollout correction


def test_rollout_correction_token_level_truncates():
    # p - q = ln of (1.5, 0.5, 1.2 | masked 10), cap 2: w = (1.5, 0.5, 1.2, 2)
    ratio_BT = t([[1.5, 0.5, 1.2, 10.0]])
    old_logp_BT = ratio_BT.log().requires_grad_(True)
    weight_BT, stats = rollout_correction(old_logp_BT, torch.zeros(1, 4, dtype=F64), t([[1, 1, 1, 0]]), level="token", cap=2.0)
    close(weight_BT, [[1.5, 0.5, 1.2, 2.0]])
    assert not weight_BT.requires_grad
    # over the 3 valid tokens: mean (1.5 + 0.5 + 1.2) / 3 = 1.066667, max 1.5 (2 if the masked token counted),
    # capped share 0 (1/4 if the masked token counted)
    close(stats["rollout_corr/weight_mean"], 3.2 / 3)
    close(stats["rollout_corr/weight_max"], 1.5)
    close(stats["rollout_corr/capped_frac"], 0.0)
    # ratios (3, 0.25), cap 2 -> w = (2, 0.25): mean 1.125, max 2, capped 1 of 2
    weight_BT, stats = rollout_correction(t([[math.log(3.0), math.log(0.25)]]), torch.zeros(1, 2, dtype=F64),
                                          torch.ones(1, 2), level="token", cap=2.0)
    close(weight_BT, [[2.0, 0.25]])
    close(stats["rollout_corr/weight_mean"], 1.125)
    close(stats["rollout_corr/weight_max"], 2.0)
    close(stats["rollout_corr/capped_frac"], 0.5)


def test_rollout_correction_sequence_level_masks():
    # cap 2: keep a sequence iff 1/2 <= rho <= 2, i.e. |sum_t (p - q)| <= ln 2 = 0.693147
    # row 0: 0.3 + 0.3 = 0.6 -> rho 1.822 kept;  row 1: 0.5 + 0.3 = 0.8 -> rho 2.226 masked
    # row 2: -0.5 - 0.3 = -0.8 -> rho 0.449 masked;  row 3: -0.3 (+ masked 5.0, which must not count) -> 0.741 kept
    diff_BT = t([[0.3, 0.3], [0.5, 0.3], [-0.5, -0.3], [-0.3, 5.0]])
    mask_BT = t([[1, 1], [1, 1], [1, 1], [1, 0]])
    weight_BT, stats = rollout_correction(diff_BT, torch.zeros(4, 2, dtype=F64), mask_BT, level="sequence", cap=2.0)
    close(weight_BT, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    close(stats["rollout_corr/masked_frac"], 0.5)  # 2 of 4 sequences
    close(stats["rollout_corr/weight_mean"], 3 / 7)  # 3 kept valid tokens of 7
    close(stats["rollout_corr/weight_max"], 1.0)
    # a huge per-token gap is clamped to 20 and still masked, without inf / nan
    weight_BT, stats = rollout_correction(t([[1e4, 1e4]]), t([[0.0, 0.0]]), torch.ones(1, 2), level="sequence", cap=2.0)
    close(weight_BT, [[0.0, 0.0]])
    assert all(torch.isfinite(v).all() for v in stats.values())


def test_rollout_correction_unknown_level_and_bad_cap():
    assert sorted(ROLLOUT_CORRECTIONS) == ["geo_rs", "icepop", "seq_mis", "sequence", "token"]
    with pytest.raises(ValueError, match="unknown rollout correction level 'geo'.*token.*sequence"):
        rollout_correction(t([[0.0]]), t([[0.0]]), t([[1.0]]), level="geo", cap=2.0)
    with pytest.raises(AssertionError, match="cap"):
        rollout_correction(t([[0.0]]), t([[0.0]]), t([[1.0]]), level="token", cap=1.0)


def test_kl_and_aggregation_names_live_in_their_registries():
    assert sorted(KL_ESTIMATORS) == ["abs", "k1", "k2", "k3", "low_var_kl"]
    assert sorted(LOSS_AGGREGATIONS) == sorted(LOSS_AGG_MODES)


# ---------------------------------------------------------------------------------- aggregation

# loss (1 2 3 / 4 99 99), mask (1 1 1 / 1 0 0): the 99s are masked out and must not count
AGG_LOSS_BT = [[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]]
AGG_MASK_BT = [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 2.5),  # sum(m l) = 1 + 2 + 3 + 4 = 10 over 4 tokens = 2.5
        ("seq-mean-token-mean", 3.0),  # seq means 6 / 3 = 2 and 4 / 1 = 4 -> (2 + 4) / 2 = 3
        ("seq-mean-token-sum", 5.0),  # seq sums 6 and 4 -> (6 + 4) / 2 = 5
        ("seq-mean-token-sum-norm", 10.0 / 6.0),  # 10 / (2 seqs x T = 3) = 1.666667
    ],
)
def test_aggregate_loss_modes_on_own_batch(mode, expected):
    close(aggregate_loss(t(AGG_LOSS_BT), t(AGG_MASK_BT), mode), expected)
    # a boolean mask gives the same
    close(aggregate_loss(t(AGG_LOSS_BT), torch.tensor(AGG_MASK_BT, dtype=torch.bool), mode), expected)


@pytest.mark.parametrize(
    "mode, expected",
    [
        # this 2x3 batch as one micro-batch of a mini-batch of 4 sequences and 8 tokens, L_max = 5
        ("token-mean", 10.0 / 8.0),  # 10 / 8 = 1.25
        ("seq-mean-token-mean", 6.0 / 4.0),  # (2 + 4) / 4 = 1.5
        ("seq-mean-token-sum", 10.0 / 4.0),  # (6 + 4) / 4 = 2.5
        ("seq-mean-token-sum-norm", 10.0 / 20.0),  # 10 / (4 x 5) = 0.5
    ],
)
def test_aggregate_loss_modes_with_mini_batch_normalizers(mode, expected):
    share = aggregate_loss(t(AGG_LOSS_BT), t(AGG_MASK_BT), mode, num_tokens=8.0, num_seqs=4.0, max_response_len=5)
    close(share, expected)


def test_loss_normalizers_count_tokens_and_sequences():
    assert loss_normalizers(t(AGG_MASK_BT)) == {"num_tokens": 4.0, "num_seqs": 2.0}


def test_aggregate_loss_unknown_mode_lists_valid_modes():
    assert sorted(LOSS_AGGREGATIONS) == sorted(LOSS_AGG_MODES)
    with pytest.raises(ValueError, match="seq-mean") as excinfo:
        aggregate_loss(t(AGG_LOSS_BT), t(AGG_MASK_BT), "seq-sum")
    message = str(excinfo.value)
    assert "seq-sum" in message
    for mode in LOSS_AGG_MODES:
        assert mode in message


# ------------------------------------------------------------------------------------ KL, entropy


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # d = logp_ref - logp = (-1, +1, 0)
        ("k1", [1.0, -1.0, 0.0]),  # -d
        ("abs", [1.0, 1.0, 0.0]),  # |d|
        ("k2", [0.5, 0.5, 0.0]),  # d^2 / 2
        ("k3", [math.exp(-1.0), math.e - 2.0, 0.0]),  # e^d - d - 1: e^-1 + 1 - 1 = 0.367879, e - 2 = 0.718282, 0
        ("low_var_kl", [math.exp(-1.0), math.e - 2.0, 0.0]),  # alias of k3
    ],
)
def test_kl_penalty_estimators(estimator, expected):
    logp_BT = t([[-1.0, -2.0, -0.5]])
    ref_logp_BT = t([[-2.0, -1.0, -0.5]])
    close(kl_penalty(logp_BT, ref_logp_BT, estimator), [expected])


def test_kl_penalty_default_is_k3():
    logp_BT, ref_logp_BT = t([[-1.0]]), t([[-1.5]])
    close(kl_penalty(logp_BT, ref_logp_BT), kl_penalty(logp_BT, ref_logp_BT, "k3"))


def test_kl_penalty_k3_clamps():
    # d = -5: e^-5 + 5 - 1 = 4.006738 (inside [-10, 10], untouched)
    # d = +3: e^3 - 3 - 1 = 16.0855 -> 10;  d = -12: e^-12 + 12 - 1 = 11.000006 -> 10
    # d = +1e4: d' = 20, e^20 - 21 = 4.85e8 -> 10 (without d' the gradient would be inf * 0 = nan)
    # d = -1e4: d' = -20, e^-20 + 19 = 19.000000002 -> 10
    d_BT = t([[-5.0, 3.0, -12.0, 1e4, -1e4]])
    logp_BT = torch.zeros_like(d_BT, requires_grad=True)
    k3_BT = kl_penalty(logp_BT, d_BT, "k3")  # ref_logp = d, logp = 0
    close(k3_BT, [[math.exp(-5.0) + 4.0, 10.0, 10.0, 10.0, 10.0]])
    k3_BT.sum().backward()
    assert torch.isfinite(logp_BT.grad).all()
    # d/dlogp (e^d - d - 1) = -(e^d - 1) = 1 - e^-5 at d = -5; 0 where the [-10, 10] clamp is active
    close(logp_BT.grad, [[1.0 - math.exp(-5.0), 0.0, 0.0, 0.0, 0.0]])
    assert (k3_BT >= -10).all() and (k3_BT <= 10).all()


def test_kl_penalty_unknown_estimator_lists_valid_ones():
    with pytest.raises(ValueError, match="k4") as excinfo:
        kl_penalty(t([[0.0]]), t([[0.0]]), "k4")
    for name in ("k1", "k2", "k3", "abs", "low_var_kl"):
        assert name in str(excinfo.value)


def test_entropy_uniform_is_log_v():
    # uniform over V = 4 (any constant logits): H = ln 4 = 1.386294
    logits_BTV = torch.full((2, 3, 4), 7.0)
    entropy_BT = entropy_from_logits(logits_BTV)
    assert entropy_BT.shape == (2, 3)
    close(entropy_BT, torch.full((2, 3), math.log(4.0)))


def test_entropy_one_hot_is_zero():
    # logits (100, 0, 0, 0): p of the others ~ e^-100 -> H ~ 3 * 101 * e^-100 ~ 1e-41
    entropy_BT = entropy_from_logits(t([[[100.0, 0.0, 0.0, 0.0]]]))
    close(entropy_BT, [[0.0]])


def test_entropy_hand_case_with_temperature():
    # z = (0, ln 3) -> p = (1/4, 3/4): H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    close(entropy_from_logits(t([[[0.0, math.log(3.0)]]])), [[0.562335]], atol=1e-6)
    # temperature 2 on z = (0, 2 ln 3): scaled logits (0, ln 3), the same distribution and entropy
    close(entropy_from_logits(t([[[0.0, 2 * math.log(3.0)]]]) / 2.0), [[0.562335]], atol=1e-6)


def test_token_logprobs_hand_case():
    # z = (0, ln 3): p = (1/4, 3/4); target 1 -> log 3/4 = -0.287682, target 0 -> log 1/4 = -1.386294;
    # entropy 0.562335 (test_entropy_hand_case_with_temperature); temperature 2 on 2z: the same numbers
    z = math.log(3.0)
    logp_N, ent_N = token_logprobs(torch.tensor([[0.0, z], [0.0, z]]), torch.tensor([1, 0]), with_entropy=True)
    close(logp_N, [-0.287682, -1.386294])
    close(ent_N, [0.562335, 0.562335])
    logp_N, _ = token_logprobs(torch.tensor([[0.0, 2 * z]]), torch.tensor([1]), temperature=2.0)
    close(logp_N, [-0.287682])


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_token_logprobs_chunked_equal_unchunked_and_autograd(chunk):
    """Values and gradients (log-prob and entropy terms) do not depend on the chunk, and match autograd."""
    gen = torch.Generator().manual_seed(0)
    logits_NV = (3 * torch.randn(11, 9, generator=gen, dtype=torch.float32)).requires_grad_(True)
    targets_N = torch.randint(0, 9, (11,), generator=gen)
    w_logp, w_ent = torch.randn(11, generator=gen), torch.randn(11, generator=gen)
    tau = 0.7

    logp_N, ent_N = token_logprobs(logits_NV, targets_N, tau, chunk_tokens=chunk, with_entropy=True)
    (grad,) = torch.autograd.grad((w_logp * logp_N + w_ent * ent_N).sum(), logits_NV)
    whole_logp, whole_ent = token_logprobs(logits_NV, targets_N, tau, chunk_tokens=11, with_entropy=True)
    (whole_grad,) = torch.autograd.grad((w_logp * whole_logp + w_ent * whole_ent).sum(), logits_NV)
    close(logp_N, whole_logp.detach())
    close(ent_N, whole_ent.detach())
    close(grad, whole_grad)

    s_NV = logits_NV / tau  # reference: autograd through log_softmax
    ref_logp = torch.log_softmax(s_NV, -1).gather(-1, targets_N[:, None]).squeeze(-1)
    ref_ent = entropy_from_logits(s_NV)
    (ref_grad,) = torch.autograd.grad((w_logp * ref_logp + w_ent * ref_ent).sum(), logits_NV)
    close(logp_N, ref_logp.detach())
    close(ent_N, ref_ent.detach())
    close(grad, ref_grad)


def test_token_logprobs_gradcheck_in_double():
    gen = torch.Generator().manual_seed(1)
    logits_NV = torch.randn(5, 4, generator=gen, dtype=F64, requires_grad=True)
    targets_N = torch.randint(0, 4, (5,), generator=gen)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, targets_N, 1.3, chunk_tokens=2, with_entropy=True), (logits_NV,))


def test_token_logprobs_of_bf16_logits_are_fp32_with_bf16_gradients():
    logits_NV = torch.randn(6, 5).to(torch.bfloat16).requires_grad_(True)
    logp_N, _ = token_logprobs(logits_NV, torch.zeros(6, dtype=torch.long), chunk_tokens=4)
    assert logp_N.dtype == torch.float32
    logp_N.sum().backward()
    assert logits_NV.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- reward shaping, sampling


def test_overlong_penalty_buffer():
    # L_max = 20, B = 4, p = 1: expected length 16; penalty min(-(L - 16) / 4, 0)
    # L = 10 -> +1.5 clipped to 0; 16 -> 0; 17 -> -0.25; 18 -> -0.5; 19 -> -0.75; 20 -> -1.0
    lengths_B = torch.tensor([10, 16, 17, 18, 19, 20])
    close(overlong_penalty(lengths_B, max_tokens=20, buffer_len=4, penalty_factor=1.0).double(),
          [0.0, 0.0, -0.25, -0.5, -0.75, -1.0])
    # p = 0.5 halves it: L = 18 -> -0.25, L = 20 -> -0.5
    close(overlong_penalty(torch.tensor([18, 20]), max_tokens=20, buffer_len=4, penalty_factor=0.5).double(),
          [-0.25, -0.5])
    # shaping is additive: R = 1, L = 19 -> R' = 1 - 0.75 = 0.25
    rewards_B = torch.tensor([1.0]) + overlong_penalty(torch.tensor([19]), 20, 4, 1.0)
    close(rewards_B.double(), [0.25])


def test_group_keep_mask_drops_zero_spread_groups():
    # groups of 4: all correct -> dropped, all wrong -> dropped, mixed -> kept; constant 0.5 -> dropped
    metric_B = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 0.5, 0.5, 0.5, 0.5])
    keep_G = group_keep_mask(metric_B, group_size=4)
    assert keep_G.dtype == torch.bool
    assert keep_G.tolist() == [False, False, True, False]


# ------------------------------------------------------ gradient does not depend on micro-batching

B, T, H, V = 8, 6, 5, 7
LENGTHS_B = [6, 1, 3, 5, 2, 6, 4, 3]  # unequal response lengths
KL_COEF, ENTROPY_COEF = 0.1, 0.01
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def _mini_batch():
    """A tiny 'policy' (one Linear over fixed features) and one mini-batch of 8 sequences, in float64."""
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(H, V, dtype=F64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen, dtype=F64))
        head.bias.copy_(torch.randn(V, generator=gen, dtype=F64))
    feats_BTH = torch.randn(B, T, H, generator=gen, dtype=F64)
    tokens_BT = torch.randint(0, V, (B, T), generator=gen)
    mask_BT = torch.arange(T)[None, :] < torch.tensor(LENGTHS_B)[:, None]  # bool [B, T]
    with torch.no_grad():
        logp_BT = torch.log_softmax(head(feats_BTH), -1).gather(-1, tokens_BT[..., None]).squeeze(-1)
    # old / reference log-probs far enough from the current ones that both clip sides and the dual clip fire
    old_logp_BT = logp_BT + 1.0 * torch.randn(B, T, generator=gen, dtype=F64)
    ref_logp_BT = logp_BT + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    adv_BT = grpo_advantages(rewards_B, group_size=4).to(F64)[:, None].expand(B, T)
    # the rollout engine's log-probs, off the trainer's old ones (drawn last: the draws above are unchanged)
    engine_logp_BT = old_logp_BT + 0.5 * torch.randn(B, T, generator=gen, dtype=F64)
    return head, feats_BTH, tokens_BT, mask_BT, old_logp_BT, ref_logp_BT, adv_BT, engine_logp_BT


def _accumulated_grad(
    mode: str, micro_batch_size: int, whole_batch_normalizers: bool = True, loss: str = "vanilla", level: str | None = None
):
    """Gradient accumulation over micro-batches; returns (summed loss, flat gradient).

    `loss` names the policy loss; `level` (token / sequence) weights it by the rollout correction.
    """
    head, feats_BTH, tokens_BT, mask_BT, old_logp_BT, ref_logp_BT, adv_BT, engine_logp_BT = _mini_batch()
    loss_fn = get_policy_loss_fn(loss)
    norms = loss_normalizers(mask_BT) if whole_batch_normalizers else {}
    total = 0.0
    n_micro = B // micro_batch_size
    for start in range(0, B, micro_batch_size):
        mb = slice(start, start + micro_batch_size)
        logits_BTV = head(feats_BTH[mb])
        logp_BT = torch.log_softmax(logits_BTV, -1).gather(-1, tokens_BT[mb, :, None]).squeeze(-1)
        pg_BT, _ = loss_fn(logp_BT, old_logp_BT[mb], adv_BT[mb], mask_BT[mb], **CLIP)
        if level is not None:
            pg_BT = pg_BT * rollout_correction(old_logp_BT[mb], engine_logp_BT[mb], mask_BT[mb], level=level, cap=2.0)[0]
        kl_BT = kl_penalty(logp_BT, ref_logp_BT[mb], "k3")
        ent_BT = entropy_from_logits(logits_BTV)

        def agg(x_BT):
            return aggregate_loss(x_BT, mask_BT[mb], mode, max_response_len=T, **norms)

        mb_loss = agg(pg_BT) + KL_COEF * agg(kl_BT) - ENTROPY_COEF * agg(ent_BT)
        if not whole_batch_normalizers:
            mb_loss = mb_loss / n_micro  # the usual (wrong for unequal lengths) accumulation
        mb_loss.backward()
        total += mb_loss.item()
    grad = torch.cat([head.weight.grad.flatten(), head.bias.grad.flatten()])
    return total, grad


def _reference_loss(mode: str, loss: str = "vanilla", level: str | None = None) -> float:
    """The mini-batch loss computed straight from the formulas of docs/algorithms.md, without aggregate_loss."""
    head, feats_BTH, tokens_BT, mask_BT, old_logp_BT, ref_logp_BT, adv_BT, engine_logp_BT = _mini_batch()
    with torch.no_grad():
        logits_BTV = head(feats_BTH)
        logp_BT = torch.log_softmax(logits_BTV, -1).gather(-1, tokens_BT[..., None]).squeeze(-1)
        pg_BT, _ = get_policy_loss_fn(loss)(logp_BT, old_logp_BT, adv_BT, mask_BT, **CLIP)
        if level is not None:
            pg_BT = pg_BT * rollout_correction(old_logp_BT, engine_logp_BT, mask_BT, level=level, cap=2.0)[0]
        l_BT = pg_BT + KL_COEF * kl_penalty(logp_BT, ref_logp_BT, "k3") - ENTROPY_COEF * entropy_from_logits(logits_BTV)
    m_BT = mask_BT.to(F64)
    if mode == "token-mean":
        return ((m_BT * l_BT).sum() / m_BT.sum()).item()
    if mode == "seq-mean-token-mean":
        return ((m_BT * l_BT).sum(-1) / m_BT.sum(-1)).mean().item()
    if mode == "seq-mean-token-sum":
        return (m_BT * l_BT).sum(-1).mean().item()
    assert mode == "seq-mean-token-sum-norm"
    return ((m_BT * l_BT).sum() / (B * T)).item()


def test_mini_batch_exercises_every_clip_branch():
    # guard for the test below: its data must hit both clip sides and the dual clip
    head, feats_BTH, tokens_BT, mask_BT, old_logp_BT, ref_logp_BT, adv_BT, _ = _mini_batch()
    with torch.no_grad():
        logp_BT = torch.log_softmax(head(feats_BTH), -1).gather(-1, tokens_BT[..., None]).squeeze(-1)
    ratio_BT = torch.exp(logp_BT - old_logp_BT)[mask_BT]
    adv = adv_BT[mask_BT]
    assert ((adv > 0) & (ratio_BT > 1.28)).any() and ((adv < 0) & (ratio_BT < 0.8)).any()
    assert ((adv < 0) & (ratio_BT > 3.0)).any()
    _, stats = policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, **CLIP)
    assert 0 < stats["pg_clipfrac"] < 1 and stats["pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_independent_of_micro_batching(mode):
    # splits 1x8, 2x4, 4x2, 8x1 with whole-mini-batch normalisers: same loss, same gradient (float64)
    loss_ref, grad_ref = _accumulated_grad(mode, micro_batch_size=8)
    assert loss_ref == pytest.approx(_reference_loss(mode), abs=1e-6)
    assert grad_ref.abs().max() > 1e-3, "the check needs a real gradient"
    for micro_batch_size in (4, 2, 1):
        loss, grad = _accumulated_grad(mode, micro_batch_size)
        assert loss == pytest.approx(loss_ref, abs=1e-6), f"{mode}: loss differs for micro-batches of {micro_batch_size}"
        torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=0,
                                   msg=lambda m: f"{mode}, micro-batches of {micro_batch_size}: {m}")


def test_per_micro_batch_normalizers_would_break_the_invariance():
    # negative control: normalising token-mean per micro-batch (and dividing by their number) weighs the tokens
    # of short micro-batches more, so the gradient changes with the split; the test above has the power to see it
    _, grad_whole = _accumulated_grad("token-mean", micro_batch_size=8, whole_batch_normalizers=False)
    _, grad_split = _accumulated_grad("token-mean", micro_batch_size=2, whole_batch_normalizers=False)
    assert (grad_whole - grad_split).abs().max() > 1e-3


@pytest.mark.parametrize(
    "loss, mode, level",
    [
        ("gspo", "seq-mean-token-mean", None),  # GSPO as the paper aggregates it
        ("gspo", "token-mean", None),
        ("cispo", "token-mean", None),  # CISPO as the paper aggregates it
        ("cispo", "seq-mean-token-sum-norm", None),
        ("vanilla", "token-mean", "token"),  # TIS weights
        ("vanilla", "seq-mean-token-mean", "sequence"),  # MIS masks
        ("gspo", "seq-mean-token-mean", "sequence"),
    ],
)
def test_other_losses_and_rollout_correction_independent_of_micro_batching(loss, mode, level):
    # GSPO's sequence ratio and MIS's sequence mask read only their own sequence, so cutting the
    # mini-batch between sequences changes nothing: same loss, same gradient for 1x8, 2x4, 4x2, 8x1
    loss_ref, grad_ref = _accumulated_grad(mode, micro_batch_size=8, loss=loss, level=level)
    assert loss_ref == pytest.approx(_reference_loss(mode, loss, level), abs=1e-6)
    assert grad_ref.abs().max() > 1e-3, "the check needs a real gradient"
    # and the variant matters: the vanilla loss without correction gives another gradient
    _, grad_vanilla = _accumulated_grad(mode, micro_batch_size=8)
    assert (grad_ref - grad_vanilla).abs().max() > 1e-4
    for micro_batch_size in (4, 2, 1):
        loss_mb, grad = _accumulated_grad(mode, micro_batch_size, loss=loss, level=level)
        assert loss_mb == pytest.approx(loss_ref, abs=1e-6), f"{loss}/{mode}/{level}: micro-batches of {micro_batch_size}"
        torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=0)


def test_rollout_correction_data_exercises_both_sides():
    # guard for the test above: the engine gap both caps tokens and masks some sequences but not all
    _, _, _, mask_BT, old_logp_BT, _, _, engine_logp_BT = _mini_batch()
    _, token_stats = rollout_correction(old_logp_BT, engine_logp_BT, mask_BT, level="token", cap=2.0)
    _, seq_stats = rollout_correction(old_logp_BT, engine_logp_BT, mask_BT, level="sequence", cap=2.0)
    assert token_stats["rollout_corr/capped_frac"] > 0
    assert 0 < seq_stats["rollout_corr/masked_frac"] < 1
