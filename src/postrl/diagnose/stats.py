"""Engine-vs-trainer log-prob gap statistics of the mismatch doctor: pure tensor functions, no I/O, no config.

Notation: p = the trainer's log-prob of a sampled token (old log-probs), q = the engine's sampling log-prob of
it, both under the temperature-scaled distribution; mask_BT = 1 on the tokens the policy sampled.

The per-step metrics under verl's names (`mismatch_sums`, `mismatch_metrics`, k3 per token) are
algorithms/mismatch.py's, which the actor logs every step and the doctor reports too; here are the doctor's
own breakdowns (by position, frequency, probability), the correction shares and the temperature fit.
"""

from __future__ import annotations

import math

import torch

from postrl.algorithms import rollout_correction
from postrl.algorithms.mismatch import k3_BT

CORRECTIONS = {"TIS": "token", "MIS": "sequence", "Seq-MIS": "seq_mis", "IcePop": "icepop"}  # what the doctor weighs


# ------------------------------------------------------------------------------------- the doctor's
def quantiles(values: torch.Tensor, qs=(0.5, 0.99)) -> list[float]:
    if values.numel() == 0:
        return [0.0 for _ in qs]
    return [float(v) for v in torch.quantile(values.double(), torch.tensor(qs, dtype=torch.float64))]


def gap_summary(p: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    """|p - q| (mean, p50, p99, max) and the k1 / k3 KL estimates over flat token vectors."""
    a = (p - q).abs()
    p50, p99 = quantiles(a)
    return {
        "tokens": int(a.numel()), "mean": float(a.mean()) if a.numel() else 0.0, "p50": p50, "p99": p99,
        "max": float(a.max()) if a.numel() else 0.0, "k1": float((q - p).mean()) if a.numel() else 0.0,
        "k3": float(k3_BT(p, q).mean()) if a.numel() else 0.0,
    }  # fmt: skip


def bucketed(p: torch.Tensor, q: torch.Tensor, key: torch.Tensor, edges: list[float], label) -> list[dict]:
    """`gap_summary` of the tokens whose `key` lies in [edges[i], edges[i + 1]), one row per non-empty bucket."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (key >= lo) & (key < hi)
        if sel.any():
            rows.append({"bucket": label(lo, hi), **gap_summary(p[sel], q[sel])})
    return rows


def _span(lo: float, hi: float) -> str:
    return f"{int(lo)}" if hi - lo == 1 else f"{int(lo)}-{int(hi) - 1}" if hi != math.inf else f"{int(lo)}+"


POSITION_EDGES = [0, 1, 4, 16, 64, 256, 1024, math.inf]
FREQUENCY_EDGES = [1, 2, 4, 16, 64, math.inf]  # occurrences of the token id among the batch's sampled tokens
PROB_EDGES = [0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0 + 1e-9]  # the trainer's probability of the token


def by_position(p, q, pos) -> list[dict]:
    return bucketed(p, q, pos.float(), POSITION_EDGES, _span)


def by_frequency(p, q, token_ids) -> list[dict]:
    _, inverse, counts = torch.unique(token_ids, return_inverse=True, return_counts=True)
    return bucketed(p, q, counts[inverse].float(), FREQUENCY_EDGES, _span)


def by_probability(p, q) -> list[dict]:
    return bucketed(p, q, torch.exp(p), PROB_EDGES, lambda lo, hi: f"[{lo:g}, {min(hi, 1.0):g}" + ("]" if hi > 1 else ")"))


def correction_shares(p_BT: torch.Tensor, q_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float) -> dict[str, dict[str, float]]:
    """The share of tokens and of sequences each correction would reweight or reject at `cap` (algorithms.correction):
    TIS truncates tokens whose ratio exp(p - q) exceeds the cap; MIS and Seq-MIS reject sequences whose ratio lies
    outside [1/cap, cap] (Seq-MIS weighs the others by their ratio); IcePop rejects tokens outside it."""
    m = mask_BT.float()
    has_B = m.sum(-1) > 0
    n_tok, n_seq = max(float(m.sum()), 1.0), max(float(has_B.sum()), 1.0)
    out = {}
    for name, level in CORRECTIONS.items():
        weight_BT, _ = rollout_correction(p_BT, q_BT, m, level=level, cap=cap)
        if level == "token":
            touched_BT = (torch.exp((p_BT - q_BT).clamp(-20, 20)) > cap) & (m > 0)
            what = "truncated"
        else:
            touched_BT = (weight_BT <= 0) & (m > 0)
            what = "rejected"
        out[name] = {
            "level": level, "what": what, "tokens": float(touched_BT.sum()) / n_tok,
            "sequences": float((touched_BT.any(-1) & has_B).sum()) / n_seq,
        }  # fmt: skip
    return out


def fit_temperature(z_y: torch.Tensor, lse_NK: torch.Tensor, grid: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """The temperature t of `grid` at which the trainer's log-probs z_y / t - logsumexp(z / t) (the logsumexps given
    per grid point, [N, K]) best match the engine's q: (t, mean |gap| there)."""
    logp_NK = z_y[:, None] / grid[None, :] - lse_NK
    err_K = (logp_NK - q[:, None]).abs().mean(0)
    best = int(err_K.argmin())
    return float(grid[best]), float(err_K[best])


def topk_compare(p_topk: tuple[torch.Tensor, torch.Tensor], q_topk: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Two next-token distributions at the same positions, each as its top-k (log-probs [N, k], ids [N, k]):
    the mean share of top-k ids they share, and KL(engine || trainer) over the union of the two top-k sets, each
    renormalised there (an id missing from one side's top-k gets that side's k-th log-prob, an upper bound)."""
    (p_lp, p_id), (q_lp, q_id) = p_topk, q_topk
    k = p_id.shape[1]
    overlap, kls = [], []
    for i in range(p_id.shape[0]):
        pd = dict(zip(p_id[i].tolist(), p_lp[i].tolist()))
        qd = dict(zip(q_id[i].tolist(), q_lp[i].tolist()))
        overlap.append(len(pd.keys() & qd.keys()) / k)
        union = sorted(pd.keys() | qd.keys())
        pv = torch.tensor([pd.get(t, float(p_lp[i, -1])) for t in union], dtype=torch.float64)
        qv = torch.tensor([qd.get(t, float(q_lp[i, -1])) for t in union], dtype=torch.float64)
        pv, qv = pv - torch.logsumexp(pv, 0), qv - torch.logsumexp(qv, 0)
        kls.append(float((qv.exp() * (qv - pv)).sum()))
    n = max(len(overlap), 1)
    kl = torch.tensor(kls or [0.0], dtype=torch.float64)
    return {"positions": len(overlap), "topk": k, "overlap": sum(overlap) / n, "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}
