"""The math of GRPO and DAPO as pure tensor functions (DESIGN.md section 4).

No I/O and no config objects: every function takes tensors and keyword arguments and returns tensors
(and, for losses, a dict of statistics). Shapes: B sequences, G group size, T response tokens.

- GRPO (Shao et al., 2024, DeepSeekMath): group-normalised advantages A_i = (R_i - mean) / (std + eps),
  std unbiased. Dr. GRPO (Liu et al., 2025): no division by std, and `seq-mean-token-sum-norm`
  aggregation, which removes the length and difficulty biases of the original objective.
- DAPO (Yu et al., 2025): clip-higher (eps_high > eps_low), token-level loss (`token-mean`),
  overlong reward shaping, and dynamic sampling (drop groups whose accuracy has zero spread).
- Dual clip (Ye et al., 2020): for A < 0 the loss is bounded by -A * c.

Loss aggregation is split in two so that gradients do not depend on micro-batching: the caller
computes the normalisers once for the whole mini-batch (over all ranks) with `loss_normalizers`,
and `aggregate_loss` returns each micro-batch's *share*; the shares add up to the mini-batch loss.
"""

from __future__ import annotations

from typing import Callable

import torch

# ------------------------------------------------------------------------------------- advantages


def grpo_advantages(rewards_B: torch.Tensor, group_size: int, norm_adv_by_std: bool = True, epsilon: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages. `rewards_B` is prompt-major: group g is rewards_B[g*G:(g+1)*G].

    A_i = (R_i - mean_g R) / (std_g R + epsilon) with the unbiased std (n - 1); with
    `norm_adv_by_std=False` (Dr. GRPO), A_i = R_i - mean_g R.
    """
    assert group_size >= 2, "GRPO needs at least two samples per group"
    assert rewards_B.numel() % group_size == 0, f"{rewards_B.numel()} rewards do not split into groups of {group_size}"
    rewards_BG = rewards_B.float().view(-1, group_size)
    centered_BG = rewards_BG - rewards_BG.mean(dim=1, keepdim=True)
    if norm_adv_by_std:
        centered_BG = centered_BG / (rewards_BG.std(dim=1, unbiased=True, keepdim=True) + epsilon)
    return centered_BG.reshape(-1)


def overlong_penalty(response_length_B: torch.Tensor, max_tokens: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: min(-(L - (L_max - B)) / B * p, 0)."""
    expected_len = max_tokens - buffer_len
    exceed_B = response_length_B.float() - expected_len
    return torch.clamp(-exceed_B / buffer_len * penalty_factor, max=0.0)


def group_keep_mask(metric_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling: True for groups whose metric varies (std > 0), one entry per group."""
    metric_BG = metric_B.float().view(-1, group_size)
    return metric_BG.std(dim=1, unbiased=True) > 0


# ------------------------------------------------------------------------------------ policy loss


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss (clip-higher, optional dual clip).

    r = exp(clamp(logp - logp_old, -20, 20))
    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); for A < 0 with c set: l = min(l, -A c).
    Returns the per-token loss [B, T] (to be aggregated) and masked-mean stats over this batch:
    pg_clipfrac (clipped term active), pg_clipfrac_lower (dual clip active), ppo_kl (mean logp_old - logp).
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = torch.clamp(logp_BT - old_logp_BT, -20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    loss_unclipped_BT = -adv_BT * ratio_BT
    loss_clipped_BT = -adv_BT * torch.clamp(ratio_BT, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_BT = torch.maximum(loss_unclipped_BT, loss_clipped_BT)
    clipped_BT = (loss_clipped_BT > loss_unclipped_BT).to(logp_BT.dtype)
    lower_BT = torch.zeros_like(loss_BT)
    if clip_ratio_c is not None:
        assert clip_ratio_c > 1.0, f"clip_ratio_c must be > 1, got {clip_ratio_c}"
        dual_BT = -adv_BT * clip_ratio_c
        lower_BT = ((adv_BT < 0) & (loss_BT > dual_BT)).to(logp_BT.dtype)
        loss_BT = torch.where(adv_BT < 0, torch.minimum(loss_BT, dual_BT), loss_BT)
    stats = {
        "pg_clipfrac": masked_mean(clipped_BT, mask_BT).detach(),
        "pg_clipfrac_lower": masked_mean(lower_BT, mask_BT).detach(),
        "ppo_kl": masked_mean(-log_ratio_BT, mask_BT).detach(),
    }
    return loss_BT, stats


# ---------------------------------------------------------------------------------- aggregation


def loss_normalizers(mask_BT: torch.Tensor) -> dict[str, float]:
    """Whole-mini-batch normalisers for `aggregate_loss` (sum these over ranks before use)."""
    return {"num_tokens": float(mask_BT.sum()), "num_seqs": float(mask_BT.shape[0])}


def _token_mean(loss_BT, mask_BT, num_tokens, num_seqs, max_response_len):
    return (loss_BT * mask_BT).sum() / num_tokens


def _seq_mean_token_mean(loss_BT, mask_BT, num_tokens, num_seqs, max_response_len):
    per_seq_B = (loss_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    return per_seq_B.sum() / num_seqs


def _seq_mean_token_sum(loss_BT, mask_BT, num_tokens, num_seqs, max_response_len):
    return (loss_BT * mask_BT).sum() / num_seqs


def _seq_mean_token_sum_norm(loss_BT, mask_BT, num_tokens, num_seqs, max_response_len):
    return (loss_BT * mask_BT).sum() / (num_seqs * max_response_len)


LOSS_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,  # DAPO: every token of the mini-batch weighs the same
    "seq-mean-token-mean": _seq_mean_token_mean,  # GRPO paper: every sequence weighs the same
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,  # Dr. GRPO: constant normaliser
}


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss under `mode`.

    `num_tokens` / `num_seqs` are totals over the whole mini-batch on all ranks (default: this
    batch alone). Summing the shares of all micro-batches gives the mini-batch loss exactly:
    token-mean               sum(m l) / num_tokens
    seq-mean-token-mean      sum_seqs(sum_t(m l) / sum_t m) / num_seqs
    seq-mean-token-sum       sum(m l) / num_seqs
    seq-mean-token-sum-norm  sum(m l) / (num_seqs * max_response_len)
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode '{mode}'; valid: {', '.join(LOSS_AGGREGATIONS)}")
    mask_BT = mask_BT.to(loss_BT.dtype)
    if num_tokens is None:
        num_tokens = float(mask_BT.sum().clamp(min=1))
    if num_seqs is None:
        num_seqs = float(mask_BT.shape[0])
    if max_response_len is None:
        max_response_len = mask_BT.shape[1]
    return LOSS_AGGREGATIONS[mode](loss_BT, mask_BT, max(num_tokens, 1.0), max(num_seqs, 1.0), max_response_len)


# ------------------------------------------------------------------------------------ KL, entropy


def _k1(d):
    return -d


def _abs(d):
    return d.abs()


def _k2(d):
    return 0.5 * d.square()


def _k3(d):
    d = torch.clamp(d, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "abs": _abs,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate with d = logp_ref - logp.

    k1 = -d; abs = |d|; k2 = d^2 / 2; k3 (low_var_kl, Schulman 2020) = exp(d') - d' - 1 with
    d' = clamp(d, -20, 20), clamped to [-10, 10].
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{estimator}'; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](ref_logp_BT - logp_BT)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per position: logsumexp(z) - sum(softmax(z) z). Pass scaled logits."""
    logits_BTV = logits_BTV.float()
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs_BTV * logits_BTV).sum(-1)
