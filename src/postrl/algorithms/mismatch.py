"""The engine-vs-trainer log-prob gap of each training step: pure tensor functions, no I/O, no config.

Notation: p = the trainer's log-prob of a sampled token (old log-probs), q = the engine's sampling log-prob of
it, both under the temperature-scaled distribution; mask_BT = 1 on the tokens the policy sampled.

Per step (`mismatch_sums` on each micro-batch, summed over micro-batches and ranks, then `mismatch_metrics`),
under verl's names:
- training/rollout_probs_diff_{mean,max,std}: |exp(p) - exp(q)| over the tokens (verl's definition: probabilities,
  not log-probs; std with Bessel's correction), training/rollout_actor_probs_pearson_corr: Pearson correlation of
  exp(p) and exp(q) over the tokens;
- rollout_corr/kl: mean of q - p (k1, KL(engine || trainer) from the engine's samples), rollout_corr/k3_kl: mean of
  exp(p - q) - (p - q) - 1 (k3, the same KL, never negative);
- rollout_corr/rollout_ppl, rollout_corr/training_ppl: the mean over sequences of exp(-mean_t q) and exp(-mean_t p).
"""

from __future__ import annotations

import math

import torch

SUM_KEYS = ("n_tok", "n_seq", "d", "d2", "x", "y", "xx", "yy", "xy", "k1", "k3", "ppl_q", "ppl_p")


def k3_BT(p_BT: torch.Tensor, q_BT: torch.Tensor) -> torch.Tensor:
    """exp(p - q) - (p - q) - 1 per token (clamped at |p - q| <= 20 as rollout correction clamps it)."""
    r = (p_BT - q_BT).clamp(-20.0, 20.0)
    return torch.exp(r) - r - 1.0


@torch.no_grad()
def mismatch_sums(p_BT: torch.Tensor, q_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[dict[str, float], float]:
    """Sufficient statistics of one micro-batch (sums over its tokens and sequences) and max |exp(p) - exp(q)|."""
    m = mask_BT.float()
    p, q = p_BT.float() * m, q_BT.float() * m
    x, y = torch.exp(p) * m, torch.exp(q) * m  # the trainer's and the engine's probabilities
    d = (x - y).abs()
    n_B = m.sum(-1)
    has = n_B > 0
    mean_p_B, mean_q_B = p.sum(-1) / n_B.clamp(min=1), q.sum(-1) / n_B.clamp(min=1)
    sums = {
        "n_tok": m.sum(), "n_seq": has.float().sum(), "d": d.sum(), "d2": (d * d).sum(), "x": x.sum(), "y": y.sum(),
        "xx": (x * x).sum(), "yy": (y * y).sum(), "xy": (x * y).sum(), "k1": (q - p).sum(), "k3": (k3_BT(p, q) * m).sum(),
        "ppl_q": (torch.exp(-mean_q_B) * has).sum(), "ppl_p": (torch.exp(-mean_p_B) * has).sum(),
    }  # fmt: skip
    return {k: float(v) for k, v in sums.items()}, float(d.max()) if m.any() else 0.0


def mismatch_metrics(sums: dict[str, float], max_diff: float) -> dict[str, float]:
    """verl's names from the summed `mismatch_sums` (module docstring); {} without tokens."""
    n = sums["n_tok"]
    if n <= 0:
        return {}
    mean = sums["d"] / n
    var = max(sums["d2"] - n * mean * mean, 0.0) / max(n - 1, 1)
    cov = sums["xy"] - sums["x"] * sums["y"] / n
    vx, vy = sums["xx"] - sums["x"] ** 2 / n, sums["yy"] - sums["y"] ** 2 / n
    corr = cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else 1.0  # identical constant columns: perfectly matched
    n_seq = max(sums["n_seq"], 1.0)
    return {
        "training/rollout_probs_diff_mean": mean,
        "training/rollout_probs_diff_max": max_diff,
        "training/rollout_probs_diff_std": math.sqrt(var),
        "training/rollout_actor_probs_pearson_corr": max(-1.0, min(1.0, corr)),
        "rollout_corr/kl": sums["k1"] / n,
        "rollout_corr/k3_kl": sums["k3"] / n,
        "rollout_corr/rollout_ppl": sums["ppl_q"] / n_seq,
        "rollout_corr/training_ppl": sums["ppl_p"] / n_seq,
    }


class MismatchAccumulator:
    """`mismatch_sums` of several micro-batches, reduced by the caller's sum / max functions (over ranks)."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        self.max_diff = 0.0
        self.seen = False

    def add(self, p_BT: torch.Tensor, q_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
        sums, mx = mismatch_sums(p_BT, q_BT, mask_BT)
        for k, v in sums.items():
            self.sums[k] += v
        self.max_diff, self.seen = max(self.max_diff, mx), True

    def metrics(self, reduce_sum, reduce_max) -> dict[str, float]:
        sums = reduce_sum(self.sums)
        return mismatch_metrics(sums, reduce_max(self.max_diff))
