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
