"""More per-token policy losses, as verl registers them: GPG, SAPO, GMPO (geo_mean), Clip-Cov and KL-Cov.

Each takes the `PolicyLossFn` signature of losses.py and returns the per-token loss [B, T] (aggregated by the
caller) with masked-mean statistics; docs/algorithms.md explains each (paper, trade-off). Their own
hyperparameters carry verl's names and defaults (`algorithm.policy_loss_args`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.algorithms.common import masked_mean
from postrl.algorithms.losses import LossAndStats, Param, _clipped_surrogate, _loss_stats, register_policy_loss


def _zero_stats(log_ratio_BT: Tensor, mask_BT: Tensor, **extra: Tensor) -> dict[str, Tensor]:
    """The shared stats of a loss that clips nothing: pg_clipfrac = pg_clipfrac_lower = 0, ppo_kl."""
    none_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    return {**_loss_stats(none_BT, none_BT, log_ratio_BT, mask_BT), **extra}


def token_covariance(adv_BT: Tensor, logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-token centred product (A - mean A)(logp - mean logp), the means over the valid tokens (no gradient).

    Its mean is Cov(logp, A) over the batch, which drives the change of the policy's entropy under a policy-
    gradient step (Cui et al., 2025: entropy falls where confident tokens get positive advantages)."""
    mask_BT = mask_BT.to(logp_BT.dtype)
    logp_BT, adv_BT = logp_BT.detach(), adv_BT.detach()
    return (adv_BT - masked_mean(adv_BT, mask_BT)) * (logp_BT - masked_mean(logp_BT, mask_BT))


def _pick_at_random(where_BT: Tensor, count: int) -> Tensor:
    """A bool [B, T] with `count` of the True positions of `where_BT` (all when fewer), chosen by torch.randperm on the
    default CPU generator over the positions in row-major order (as verl's clip_cov, so a seeded run picks the same)."""
    flat_N = where_BT.reshape(-1).nonzero().squeeze(1)
    picked = torch.zeros(where_BT.numel(), dtype=torch.bool, device=where_BT.device)
    if flat_N.numel():
        order = torch.randperm(flat_N.numel()).to(flat_N.device)
        picked[flat_N[order[:count]]] = True
    return picked.view_as(where_BT)


@register_policy_loss("gpg", defaults={"loss_agg_mode": "token-mean"})
def gpg_policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                    clip_ratio_high: float, clip_ratio_c: float | None = None) -> LossAndStats:
    """GPG (Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning", arXiv
    2504.02546): the plain policy gradient, l = -A logp, with no ratio, no clip and no reference.

    Every update is a REINFORCE step on the batch, however far the policy has moved since it was sampled, so it
    suits one update per batch (train.epochs_per_batch 1, mini batch = global batch). The clip settings are
    ignored; pg_clipfrac and pg_clipfrac_lower are 0; ppo_kl is reported. The paper's token-mean is preferred.
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    return -adv_BT * logp_BT, _zero_stats(logp_BT - old_logp_BT, mask_BT)


@register_policy_loss(
    "sapo",
    params={
        "tau_pos": Param(1.0, "Temperature of the soft gate for tokens with A > 0 (verl's actor.tau_pos).", gt=0.0),
        "tau_neg": Param(1.05, "Temperature of the soft gate for tokens with A <= 0 (verl's actor.tau_neg).", gt=0.0),
    },
    defaults={"loss_agg_mode": "seq-mean-token-mean"},
)
def sapo_policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                     clip_ratio_high: float, clip_ratio_c: float | None = None, tau_pos: float, tau_neg: float) -> LossAndStats:
    """SAPO (Gao et al., 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a smooth gate instead of a clip.

    r = exp(clamp(logp - logp_old, -20, 20)),  tau = tau_pos if A > 0 else tau_neg
    l = -A f(r),  f(r) = sigmoid(tau (r - 1)) x 4 / tau
    f'(r) = 4 s (1 - s) with s = sigmoid(tau (r - 1)): 1 at r = 1 (the gradient of the vanilla loss on-policy),
    falling smoothly as r leaves 1, so a token far off-policy is damped rather than cut off at the clip edge.
    A larger tau narrows the trust region; tau_neg > tau_pos damps negative updates more (they destabilise more).
    The clip settings are ignored (pg_clipfrac = pg_clipfrac_lower = 0). verl aggregates it seq-mean-token-mean
    whatever loss_agg_mode says; here that is the preferred default and an explicit loss_agg_mode wins.
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = torch.clamp(logp_BT - old_logp_BT, -20.0, 20.0)
    tau_BT = torch.where(adv_BT > 0, torch.full_like(adv_BT, tau_pos), torch.full_like(adv_BT, tau_neg))
    gate_BT = torch.sigmoid(tau_BT * (torch.exp(log_ratio_BT) - 1.0)) * (4.0 / tau_BT)
    return -gate_BT * adv_BT, _zero_stats(log_ratio_BT, mask_BT)


@register_policy_loss("geo_mean", defaults={"loss_agg_mode": "seq-mean-token-mean"})
def geo_mean_policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                         clip_ratio_high: float, clip_ratio_c: float | None = None) -> LossAndStats:
    """GMPO (Zhao et al., 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673): the geometric mean of the
    token ratios of a sequence, clipped per token in log space.

    d_t  = logp_t - logp_old_t,  d'_t = clip(d_t, -eps_low, eps_high) on the pessimistic side only
           (A > 0: min(d, clip(d)); A < 0: max(d, clip(d)))
    s_i  = exp(sum_t m_t d'_t / |y_i|),  A_i = sum_t m_t A_t / |y_i|,  l_i = -A_i s_i (on every token of row i)
    The arithmetic mean of GRPO lets one token with an extreme ratio dominate a sequence's update; the geometric
    mean damps it, so the paper widens the clip to (e^-0.4, e^0.4) (eps 0.4 here, bounds in log space) with
    steadier importance ratios and a higher entropy. With seq-mean-token-mean (preferred; verl always takes the
    mean over sequences) the aggregate is mean_i l_i. No dual clip (clip_ratio_c is ignored) and no clamp of d.
    pg_clipfrac / pg_clipfrac_lower: tokens whose d was outside the range with A > 0 / A < 0.
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = logp_BT - old_logp_BT
    sign_BT = torch.sign(adv_BT)
    bounded_BT = torch.clamp(log_ratio_BT, -clip_ratio_low, clip_ratio_high)
    pessimistic_BT = sign_BT * torch.minimum(sign_BT * log_ratio_BT, sign_BT * bounded_BT)
    length_B = mask_BT.sum(-1) + 1e-8
    seq_ratio_B = torch.exp((pessimistic_BT * mask_BT).sum(-1) / length_B)
    seq_adv_B = (adv_BT * mask_BT).sum(-1) / length_B
    loss_BT = (-seq_adv_B * seq_ratio_B)[:, None].expand_as(logp_BT)
    outside_BT = log_ratio_BT != bounded_BT
    return loss_BT, _loss_stats(outside_BT & (adv_BT > 0), outside_BT & (adv_BT < 0), log_ratio_BT, mask_BT)


_COV_PARAMS = {
    "clip_cov_ratio": Param(2e-4, "Share of the valid tokens whose gradient is detached (verl's policy_loss.clip_cov_ratio).", gt=0.0, le=1.0),
    "clip_cov_lb": Param(1.0, "Tokens with a covariance above this are candidates (verl's policy_loss.clip_cov_lb)."),
    "clip_cov_ub": Param(5.0, "Tokens with a covariance below this are candidates (verl's policy_loss.clip_cov_ub)."),
}


@register_policy_loss("clip_cov", params=_COV_PARAMS)
def clip_cov_policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                         clip_ratio_high: float, clip_ratio_c: float | None = None, clip_cov_ratio: float,
                         clip_cov_lb: float, clip_cov_ub: float) -> LossAndStats:
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv 2505.22617): PPO's clipped loss, with the gradient of a few high-covariance tokens detached.

    c_t = (A_t - mean A)(logp_t - mean logp) over the micro-batch's valid tokens (`token_covariance`). Among the
    valid tokens that PPO's clip left active and with clip_cov_lb < c_t < clip_cov_ub, max(1, int(clip_cov_ratio x
    valid tokens)) are picked at random and their loss set to 0 (no gradient). The entropy of the policy falls in
    proportion to Cov(logp, A); the few tokens with the largest c_t (confident tokens with a positive advantage,
    unlikely ones with a negative one) carry most of that fall, so withholding their update keeps the entropy up
    at the cost of a little signal. r = exp(logp - logp_old) is not clamped and clip_ratio_c is ignored (verl's).
    pg_clipfrac: the share of valid tokens detached by the covariance (verl's); pg_clipfrac_lower 0.
    """
    valid_BT = mask_BT > 0
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = logp_BT - old_logp_BT
    loss_BT, clipped_BT = _clipped_surrogate(torch.exp(log_ratio_BT), adv_BT, clip_ratio_low, clip_ratio_high)
    cov_BT = token_covariance(adv_BT, logp_BT, mask_BT)
    band_BT = valid_BT & ~clipped_BT & (cov_BT > clip_cov_lb) & (cov_BT < clip_cov_ub)
    detached_BT = _pick_at_random(band_BT, max(int(clip_cov_ratio * float(mask_BT.sum())), 1))
    loss_BT = torch.where(detached_BT, torch.zeros_like(loss_BT), loss_BT)
    return loss_BT, _loss_stats(detached_BT, torch.zeros_like(detached_BT), log_ratio_BT, mask_BT)


@register_policy_loss(
    "kl_cov",
    params={
        "kl_cov_ratio": Param(2e-4, "Share of the valid tokens under the KL penalty (verl's policy_loss.kl_cov_ratio).", gt=0.0, le=1.0),
        "ppo_kl_coef": Param(0.1, "Weight of |logp - logp_old| on those tokens (verl's policy_loss.ppo_kl_coef).", ge=0.0),
    },
)
def kl_cov_policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                       clip_ratio_high: float, clip_ratio_c: float | None = None, kl_cov_ratio: float,
                       ppo_kl_coef: float) -> LossAndStats:
    """KL-Cov (Cui et al., 2025, arXiv 2505.22617): the unclipped policy gradient, with a KL penalty on the tokens of
    the highest covariance.

    l_t = -A_t r_t, plus ppo_kl_coef x |logp_t - logp_old_t| on the max(1, int(kl_cov_ratio x valid tokens)) valid
    tokens with the largest c_t (`token_covariance`, over the micro-batch). No clip at all: the penalty holds the
    tokens that would lower the entropy most near the old policy, which the paper finds steadier than Clip-Cov's
    hard cut. The penalty's gradient is ppo_kl_coef x sign(logp - logp_old): 0 while the policy IS the old policy,
    so it only acts from the second update on a batch (train.mini_batch_size below the global batch, or
    train.epochs_per_batch > 1); with one update per batch the loss equals the unclipped -A r.
    pg_clipfrac: the share of valid tokens under the penalty; pg_clipfrac_lower 0; ppo_kl_abs: mean |logp -
    logp_old| (what verl's kl_cov reports as ppo_kl); ppo_kl as every other loss.
    """
    valid_BT = mask_BT > 0
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = logp_BT - old_logp_BT
    loss_BT = -adv_BT * torch.exp(log_ratio_BT)
    penalised_BT = torch.zeros_like(valid_BT)
    n_valid = int(valid_BT.sum())
    if n_valid:
        cov_N = token_covariance(adv_BT, logp_BT, mask_BT)[valid_BT]
        top_N = torch.topk(cov_N, max(1, int(n_valid * kl_cov_ratio))).indices
        penalised_BT.view(-1)[valid_BT.reshape(-1).nonzero().squeeze(1)[top_N]] = True
    loss_BT = loss_BT + torch.where(penalised_BT, ppo_kl_coef * log_ratio_BT.abs(), torch.zeros_like(loss_BT))
    stats = _loss_stats(penalised_BT, torch.zeros_like(penalised_BT), log_ratio_BT, mask_BT)
    return loss_BT, {**stats, "ppo_kl_abs": masked_mean(log_ratio_BT.abs(), mask_BT).detach()}
