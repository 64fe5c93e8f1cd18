"""Engine-vs-trainer log-prob gap statistics: pure tensor functions, no I/O, no config.

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

from postrl.algorithms import rollout_correction

SUM_KEYS = ("n_tok", "n_seq", "d", "d2", "x", "y", "xx", "yy", "xy", "k1", "k3", "ppl_q", "ppl_p")
CORRECTIONS = {"TIS": "token", "MIS": "sequence", "Seq-MIS": "seq_mis", "IcePop": "icepop"}  # what the doctor weighs


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
