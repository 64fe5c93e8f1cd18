"""Loss aggregation (normalised over the whole mini-batch), KL estimators and entropy."""

from __future__ import annotations

from typing import Callable

import torch
from postrl.algorithms.common import _lookup


def loss_normalizers(mask_BT: torch.Tensor) -> dict[str, float]:
    """Whole-mini-batch normalisers for `aggregate_loss` (sum these over ranks before use).

    num_seqs counts the sequences with at least one loss token: one that rollout correction rejected
    (`rollout_loss_mask`) has none and leaves the sequence means.
    """
    return {"num_tokens": float(mask_BT.sum()), "num_seqs": float((mask_BT.sum(-1) > 0).sum())}


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
    aggregate = _lookup(LOSS_AGGREGATIONS, "loss_agg_mode", mode)
    mask_BT = mask_BT.to(loss_BT.dtype)
    if num_tokens is None:
        num_tokens = float(mask_BT.sum().clamp(min=1))
    if num_seqs is None:
        num_seqs = float(mask_BT.shape[0])
    if max_response_len is None:
        max_response_len = mask_BT.shape[1]
    return aggregate(loss_BT, mask_BT, max(num_tokens, 1.0), max(num_seqs, 1.0), max_response_len)


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
    return _lookup(KL_ESTIMATORS, "KL estimator", estimator)(ref_logp_BT - logp_BT)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per position: logsumexp(z) - sum(softmax(z) z). Pass scaled logits."""
    logits_BTV = logits_BTV.float()
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs_BTV * logits_BTV).sum(-1)
