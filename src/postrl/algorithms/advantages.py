"""Advantage estimators (by name), DAPO's overlong penalty and its group filter."""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from postrl.algorithms.common import _lookup, _register_into


class AdvEstimator(Protocol):
    """`num_tokens_B`: each sequence's loss tokens (the policy's own), for estimators that weigh by tokens
    (reinforce_plus_plus); the others ignore it. Experience always passes it."""

    def __call__(
        self, rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
        num_tokens_B: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    """Register an advantage estimator under `name` (decorator)."""
    return _register_into(ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator(name: str) -> AdvEstimator:
    """The estimator registered as `name`; a ValueError lists the valid names otherwise."""
    return _lookup(ADV_ESTIMATORS, "advantage estimator", name)


def _groups(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Prompt-major rewards as float32 groups [num_groups, G]: group g is rewards_B[g*G:(g+1)*G]."""
    assert group_size >= 2, "group advantages need at least two samples per group"
    assert rewards_B.numel() % group_size == 0, f"{rewards_B.numel()} rewards do not split into groups of {group_size}"
    return rewards_B.float().view(-1, group_size)


def _zero_where_no_spread(adv_BG: torch.Tensor, rewards_BG: torch.Tensor) -> torch.Tensor:
    # A group whose rewards are all equal carries no signal. In float32, R - mean(R) is not exactly 0
    # when R is not representable (mean([0.48918265] * 3) != 0.48918265), and dividing that rounding
    # error by std + eps turns it into an advantage of ~0.03. Zero such groups outright; every other
    # value is left bit for bit as computed.
    no_spread_G = rewards_BG.amax(dim=1) == rewards_BG.amin(dim=1)
    return adv_BG.masked_fill(no_spread_G[:, None], 0.0)


@register_adv_estimator("grpo")
def grpo_advantages(
    rewards_B: torch.Tensor, group_size: int, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
    num_tokens_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO (Shao et al., 2024, DeepSeekMath): group-relative advantages, prompt-major groups.

    A_i = (R_i - mean_g R) / (std_g R + epsilon) with the unbiased std (n - 1); with
    `norm_adv_by_std=False` (Dr. GRPO), A_i = R_i - mean_g R. A group with no spread gets exactly 0.
    """
    rewards_BG = _groups(rewards_B, group_size)
    centered_BG = rewards_BG - rewards_BG.mean(dim=1, keepdim=True)
    if norm_adv_by_std:
        centered_BG = centered_BG / (rewards_BG.std(dim=1, unbiased=True, keepdim=True) + epsilon)
    return _zero_where_no_spread(centered_BG, rewards_BG).reshape(-1)


@register_adv_estimator("drgrpo")
def drgrpo_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
    num_tokens_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): A_i = R_i - mean_g R.

    Dividing by the group std up-weights questions that are too easy or too hard (small std); Dr. GRPO
    drops it. `norm_adv_by_std` and `epsilon` are ignored (accepted for the common signature). The paper
    pairs it with `loss_agg_mode: seq-mean-token-sum-norm`.
    """
    return grpo_advantages(rewards_B, group_size, norm_adv_by_std=False)


@register_adv_estimator("rloo")
def rloo_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
    num_tokens_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024, "Back to Basics"; Kool et al., 2019): leave-one-out baseline.

    A_i = R_i - (1 / (G - 1)) sum_{j != i} R_j, i.e. G / (G - 1) x (R_i - mean_g R): an unbiased
    baseline, since it does not depend on sample i. No std normalisation: `norm_adv_by_std` and
    `epsilon` are ignored. A group with no spread gets exactly 0.
    """
    rewards_BG = _groups(rewards_B, group_size)
    others_mean_BG = (rewards_BG.sum(dim=1, keepdim=True) - rewards_BG) / (group_size - 1)
    return _zero_where_no_spread(rewards_BG - others_mean_BG, rewards_BG).reshape(-1)


def _batch_whiten(x_B: torch.Tensor, norm_adv_by_std: bool, epsilon: float, weight_B: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / (std + epsilon) over the batch; with `weight_B` (tokens per sequence) each sequence counts
    as that many tokens: mean = sum n_i x_i / N, var = sum n_i (x_i - mean)^2 / (N - 1), N = sum n_i."""
    if weight_B is None:
        assert x_B.numel() >= 2, "batch-normalised advantages need at least two sequences"
        mean, std = x_B.mean(), x_B.std(unbiased=True)
    else:
        weight_B = weight_B.to(x_B.dtype).reshape(-1)
        assert weight_B.shape == x_B.shape, f"{weight_B.numel()} token counts for {x_B.numel()} sequences"
        n = weight_B.sum()
        assert n >= 2, "token-whitened advantages need at least two loss tokens in the batch"
        mean = (weight_B * x_B).sum() / n
        std = ((weight_B * (x_B - mean).square()).sum() / (n - 1)).sqrt()  # unbiased, over tokens
    centered_B = x_B - mean
    if norm_adv_by_std:
        centered_B = centered_B / (std + epsilon)
    if x_B.amax() == x_B.amin():  # no spread in the whole batch: exactly 0 (see _zero_where_no_spread)
        centered_B = torch.zeros_like(centered_B)
    return centered_B


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
    num_tokens_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025, arXiv 2501.03262), outcome rewards: normalised over the whole batch.

    A = (R - mean_batch R) / (std_batch R + epsilon), unbiased std; no groups (`group_size` is unused),
    so a prompt whose samples all score the same still gets a non-zero advantage when the batch
    varies. `norm_adv_by_std=False` only centres.
    With `num_tokens_B` (what Experience passes, so what a run does) the mean and std are over tokens:
    each sequence's reward stands on each of its loss tokens, as the paper, verl (`masked_whiten` of the
    token returns) and OpenRLHF whiten, so long responses weigh more. Without it each sequence counts
    once (docs/algorithms.md). verl adds 1e-8 to the variance, not epsilon to the std.
    """
    return _batch_whiten(rewards_B.float().reshape(-1), norm_adv_by_std, epsilon, num_tokens_B)


@register_adv_estimator("reinforce_plus_plus_seq")
def reinforce_plus_plus_seq_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
    num_tokens_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ with each sequence counted once in the batch mean and std, whatever its length (postrl's
    form before it whitened over tokens): A = (R - mean_batch R) / (std_batch R + epsilon). `num_tokens_B`
    is ignored."""
    return _batch_whiten(rewards_B.float().reshape(-1), norm_adv_by_std, epsilon)


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6,
    num_tokens_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu, 2025, arXiv 2501.03262): group mean as baseline, batch std as scale.

    R'_i = R_i - mean_g R, then A = R' / (std_batch R' + epsilon) (unbiased std over the batch;
    `norm_adv_by_std=False` keeps A = R'). Scaling by the batch std rather than each group's avoids
    GRPO's up-weighting of near-uniform groups. A group with no spread gets exactly 0.
    """
    rewards_BG = _groups(rewards_B, group_size)
    centered_B = _zero_where_no_spread(rewards_BG - rewards_BG.mean(dim=1, keepdim=True), rewards_BG).reshape(-1)
    if not norm_adv_by_std:
        return centered_B
    return centered_B / (centered_B.std(unbiased=True) + epsilon)


def overlong_penalty(response_length_B: torch.Tensor, max_tokens: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: min(-(L - (L_max - B)) / B * p, 0)."""
    expected_len = max_tokens - buffer_len
    exceed_B = response_length_B.float() - expected_len
    return torch.clamp(-exceed_B / buffer_len * penalty_factor, max=0.0)


def group_keep_mask(metric_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling: True for groups whose metric varies (std > 0), one entry per group."""
    metric_BG = metric_B.float().view(-1, group_size)
    return metric_BG.std(dim=1, unbiased=True) > 0


# Estimators that need a value model (the critic, held/critic.py): token-level, so not of `AdvEstimator`'s
# signature. The config accepts their names as `algorithm.adv_estimator` too.
CRITIC_ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def gae_advantages(
    token_rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al., 2016) over the model tokens of each row: (advantages_BT, returns_BT).

    delta_t = r_t + gamma V_next - V_t and A_t = delta_t + gamma lam A_next, where "next" is the next
    token with mask 1: tool / environment tokens (mask 0) and trailing padding are skipped, their
    values and TD errors ignored (verl's multi-turn GAE). Past the last model token V_next = A_next = 0.
    returns = A + V. Both are 0 where the mask is 0 (the loss never reads them). Not whitened here:
    `masked_whiten` does that over the batch.
    """
    mask_BT = mask_BT.float()
    rewards_BT, values_BT = token_rewards_BT.float(), values_BT.float()
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_adv_B = torch.zeros_like(values_BT[:, 0])
    adv_BT = torch.zeros_like(values_BT)
    for t in reversed(range(values_BT.shape[1])):
        m_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        next_value_B = m_B * values_BT[:, t] + (1 - m_B) * next_value_B  # masked tokens pass "next" through
        next_adv_B = m_B * adv_B + (1 - m_B) * next_adv_B
        adv_BT[:, t] = adv_B * m_B
    return adv_BT, (adv_BT + values_BT) * mask_BT


CRITIC_ADV_ESTIMATORS["gae"] = gae_advantages


def needs_critic(adv_estimator: str) -> bool:
    """True for an estimator that reads a value model (`CRITIC_ADV_ESTIMATORS`)."""
    return adv_estimator in CRITIC_ADV_ESTIMATORS


def terminal_rewards(rewards_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, T]: each row's outcome reward on its last model token (mask 1), 0 elsewhere."""
    mask_BT = mask_BT.float()
    positions_T = torch.arange(mask_BT.shape[1], device=mask_BT.device, dtype=torch.float32)
    last_B = (mask_BT * (positions_T + 1)).argmax(dim=1)  # the last index whose mask is 1
    out_BT = torch.zeros_like(mask_BT)
    has_B = mask_BT.sum(1) > 0
    out_BT[has_B, last_B[has_B]] = rewards_B.float().to(mask_BT.device)[has_B]
    return out_BT


def masked_whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, totals: tuple[float, float, float] | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the tokens where mask is 1 (verl's masked_whiten: unbiased var).

    `totals` = (count, sum, sum of squares) over the whole batch (all ranks); default: this tensor's.
    Masked positions come out 0.
    """
    mask_BT = mask_BT.float()
    if totals is None:
        totals = whiten_totals(x_BT, mask_BT)
    n, s, sq = totals
    mean = s / max(n, 1.0)
    var = (sq / max(n, 1.0) - mean * mean) * n / max(n - 1.0, 1.0)
    return (x_BT - mean) * torch.rsqrt(torch.tensor(max(var, 0.0) + 1e-8, dtype=x_BT.dtype)) * mask_BT


def whiten_totals(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[float, float, float]:
    """(count, sum, sum of squares) of x over the mask: sum these over ranks for `masked_whiten`."""
    mask_BT = mask_BT.float()
    return float(mask_BT.sum()), float((x_BT * mask_BT).sum()), float((x_BT.square() * mask_BT).sum())
