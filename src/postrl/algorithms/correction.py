"""Rollout correction: importance weights for the gap between the rollout engine and the trainer, by level."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor
from postrl.algorithms.common import _lookup, _register_into, masked_mean


RolloutCorrectionFn = Callable[[Tensor, Tensor, float], tuple[Tensor, dict[str, Tensor]]]
ROLLOUT_CORRECTIONS: dict[str, RolloutCorrectionFn] = {}


def register_rollout_correction(name: str, *, rejects: bool) -> Callable[[RolloutCorrectionFn], RolloutCorrectionFn]:
    """Register a rollout correction level `fn(log_w_BT, mask_BT, cap) -> (weight_BT, stats)` (decorator).

    `rejects`: the level gives some valid tokens weight 0. Those tokens leave the loss altogether, its
    normalisers included (`rollout_loss_mask`), so the caller must know the weight before the update.
    """
    register = _register_into(ROLLOUT_CORRECTIONS, "rollout correction level", name)

    def deco(fn):
        fn.rejects = rejects
        return register(fn)

    return deco


def rollout_correction_rejects(level: str) -> bool:
    """Whether `level` rejects tokens (weight 0), which must then leave the loss's normalisers too."""
    return _lookup(ROLLOUT_CORRECTIONS, "rollout correction level", level).rejects


def rollout_loss_mask(weight_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """The loss mask without the tokens a rollout correction rejected (weight 0).

    As verl writes them into its response mask: a rejected sequence leaves every term of the loss and the
    token / sequence counts of `loss_normalizers`, instead of counting as a zero in the mean.
    """
    return mask_BT * (weight_BT > 0).to(mask_BT.dtype)


def _seq_log_ratio(log_w_BT: Tensor, mask_BT: Tensor) -> Tensor:
    return (log_w_BT * mask_BT).sum(-1)


def _rejected_share(keep_X: Tensor, mask_X: Tensor) -> Tensor:
    return 1.0 - masked_mean(keep_X.to(mask_X.dtype), mask_X)


@register_rollout_correction("token", rejects=False)
def _truncated_is(log_w_BT: Tensor, mask_BT: Tensor, cap: float):
    """TIS: w_t = min(exp(p_t - q_t), cap)."""
    ratio_BT = torch.exp(log_w_BT)
    weight_BT = torch.clamp(ratio_BT, max=cap)
    return weight_BT, {"rollout_corr/capped_frac": masked_mean((ratio_BT > cap).to(mask_BT.dtype), mask_BT)}


@register_rollout_correction("sequence", rejects=True)
def _masked_is(log_w_BT: Tensor, mask_BT: Tensor, cap: float):
    """MIS: w = 1 on the sequences whose rho = prod_t p_t / q_t lies in [1 / cap, cap], else 0."""
    keep_B = _seq_log_ratio(log_w_BT, mask_BT).abs() <= math.log(cap)  # in log space: rho may overflow
    weight_BT = keep_B[:, None].to(mask_BT.dtype).expand_as(mask_BT).clone()
    return weight_BT, {"rollout_corr/masked_frac": 1.0 - keep_B.to(mask_BT.dtype).mean()}


@register_rollout_correction("seq_mis", rejects=True)
def _seq_masked_is(log_w_BT: Tensor, mask_BT: Tensor, cap: float):
    """Seq-MIS (verl): MIS's rejection, and the kept sequences weighted by their ratio rho (<= cap)."""
    log_rho_B = _seq_log_ratio(log_w_BT, mask_BT)
    keep_B = log_rho_B.abs() <= math.log(cap)
    rho_B = torch.exp(log_rho_B.clamp(max=math.log(cap)))  # rejected ones are zeroed below; no overflow
    weight_BT = (rho_B * keep_B.to(rho_B.dtype))[:, None].expand_as(mask_BT).clone()
    return weight_BT, {"rollout_corr/masked_frac": 1.0 - keep_B.to(mask_BT.dtype).mean()}


@register_rollout_correction("icepop", rejects=True)
def _icepop(log_w_BT: Tensor, mask_BT: Tensor, cap: float):
    """IcePop: w_t = 1 for tokens whose ratio p_t / q_t lies in [1 / cap, cap], else 0 (two-sided token masking)."""
    keep_BT = log_w_BT.abs() <= math.log(cap)
    return keep_BT.to(mask_BT.dtype), {"rollout_corr/masked_token_frac": _rejected_share(keep_BT, mask_BT)}


@register_rollout_correction("geo_rs", rejects=True)
def _geometric_rs(log_w_BT: Tensor, mask_BT: Tensor, cap: float):
    """Geo-RS: w = 1 on the sequences whose geometric-mean ratio exp(mean_t log p_t / q_t) lies in [1 / cap, cap]."""
    mean_log_B = _seq_log_ratio(log_w_BT, mask_BT) / mask_BT.sum(-1).clamp(min=1)
    keep_B = mean_log_B.abs() <= math.log(cap)
    weight_BT = keep_B[:, None].to(mask_BT.dtype).expand_as(mask_BT).clone()
    return weight_BT, {"rollout_corr/masked_frac": 1.0 - keep_B.to(mask_BT.dtype).mean()}


def rollout_correction(
    old_logp_BT: torch.Tensor, engine_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *, level: str, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights for the gap between the rollout engine (q) and the trainer (p).

    The engine samples with q (vLLM kernels, other precision) while the loss assumes the trainer's
    p = old log-probs (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"; verl's rollout_is / rollout_rs). The weight multiplies the per-token loss before
    aggregation; tokens it sets to 0 are rejected and also leave the normalisers (`rollout_loss_mask`).
    - level "token" (TIS): w_t = min(exp(p_t - q_t), cap).
    - level "sequence" (MIS): rho_i = exp(sum_t m_t (p_t - q_t)); w = 0 on every token of a sequence
      with rho_i outside [1 / cap, cap] (rejected), else 1.
    - level "seq_mis" (verl's Seq-MIS): as "sequence", but a kept sequence is weighted by rho_i.
    - level "icepop" (IcePop): w_t = 1 if exp(p_t - q_t) lies in [1 / cap, cap], else 0 (per token).
    - level "geo_rs" (Geo-RS): as "sequence" with the geometric mean exp(mean_t m_t (p_t - q_t)) in
      place of rho_i, so the bound does not tighten with length (a cap near 1, e.g. 1.002).
    Log-differences are clamped to [-20, 20] per token. The weight is detached. Stats (masked over
    response tokens): rollout_corr/weight_mean, rollout_corr/weight_max, and rollout_corr/capped_frac
    (token share above the cap), rollout_corr/masked_frac (share of sequences rejected) or
    rollout_corr/masked_token_frac (share of tokens rejected).
    """
    correct = _lookup(ROLLOUT_CORRECTIONS, "rollout correction level", level)
    assert cap > 1.0, f"the rollout correction cap must be > 1, got {cap}"
    mask_BT = mask_BT.to(old_logp_BT.dtype)
    log_w_BT = torch.clamp(old_logp_BT - engine_logp_BT, -20.0, 20.0).detach()
    weight_BT, extra = correct(log_w_BT, mask_BT, cap)
    valid_BT = mask_BT > 0
    stats = {
        "rollout_corr/weight_mean": masked_mean(weight_BT, mask_BT),
        "rollout_corr/weight_max": weight_BT[valid_BT].max() if valid_BT.any() else weight_BT.new_zeros(()),
        **extra,
    }
    return weight_BT, {k: v.detach() for k, v in stats.items()}
