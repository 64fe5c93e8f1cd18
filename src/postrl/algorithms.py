"""The math of GRPO, DAPO and their relatives as pure tensor functions (docs/algorithms.md).

No I/O and no config objects: every function takes tensors and keyword arguments and returns tensors
(and, for losses, a dict of statistics). Shapes: B sequences, G group size, T response tokens.

Variants are chosen by name from registries, as in verl's core_algos (an unknown name raises a
ValueError that lists the valid ones); this module is the one place that holds the names:
- advantage estimators (`get_adv_estimator`): grpo, drgrpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline; one signature `fn(rewards_B, group_size, *, norm_adv_by_std, epsilon)`;
- policy losses (`get_policy_loss_fn`): vanilla, gspo, cispo, or a user's 'package.module:function'; one
  signature `fn(logp_BT, old_logp_BT, adv_BT, mask_BT, *, clip_ratio_low, clip_ratio_high, clip_ratio_c,
  **params)`. Each declares with its registration (`LossSpec`) its own hyperparameters (`Param`: default,
  range, doc; the config's `algorithm.policy_loss_args`) and the shared settings it prefers (gspo: the
  paper's clip range and seq-mean-token-mean); the config reads both from here;
- loss aggregation modes (`LOSS_AGGREGATIONS`), KL estimators (`KL_ESTIMATORS`) and rollout
  correction levels (`ROLLOUT_CORRECTIONS`, `register_rollout_correction`: token, sequence, seq_mis,
  icepop, geo_rs).

Papers:
- GRPO (Shao et al., 2024, DeepSeekMath): group-normalised advantages A_i = (R_i - mean) / (std + eps),
  std unbiased. Dr. GRPO (Liu et al., 2025): no division by std, and `seq-mean-token-sum-norm`
  aggregation, which removes the length and difficulty biases of the original objective.
- DAPO (Yu et al., 2025): clip-higher (eps_high > eps_low), token-level loss (`token-mean`),
  overlong reward shaping, and dynamic sampling (drop groups whose accuracy has zero spread).
- Dual clip (Ye et al., 2020): for A < 0 the loss is bounded by -A * c.
- RLOO (Ahmadian et al., 2024; Kool et al., 2019), REINFORCE++ (Hu, 2025), GSPO (Zheng et al., 2025),
  CISPO (MiniMax-M1, MiniMax, 2025), truncated / masked importance sampling for the rollout engine's
  mismatch (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training").

Loss aggregation is split in two so that gradients do not depend on micro-batching: the caller
computes the normalisers once for the whole mini-batch (over all ranks) with `loss_normalizers`,
and `aggregate_loss` returns each micro-batch's *share*; the shares add up to the mini-batch loss.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import Tensor


def _unknown(kind: str, name: str, valid) -> ValueError:
    return ValueError(f"unknown {kind} '{name}'; valid: {', '.join(valid)}")


def _lookup(table: dict, kind: str, name: str):
    if name not in table:
        raise _unknown(kind, name, table)
    return table[name]


def _register_into(table: dict, kind: str, name: str) -> Callable:
    def deco(fn):
        assert name not in table, f"{kind} '{name}' is registered twice"
        table[name] = fn
        return fn

    return deco


# ------------------------------------------------------------------------------------- advantages


class AdvEstimator(Protocol):
    def __call__(
        self, rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6
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
    rewards_B: torch.Tensor, group_size: int, norm_adv_by_std: bool = True, epsilon: float = 1e-6
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
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): A_i = R_i - mean_g R.

    Dividing by the group std up-weights questions that are too easy or too hard (small std); Dr. GRPO
    drops it. `norm_adv_by_std` and `epsilon` are ignored (accepted for the common signature). The paper
    pairs it with `loss_agg_mode: seq-mean-token-sum-norm`.
    """
    return grpo_advantages(rewards_B, group_size, norm_adv_by_std=False)


@register_adv_estimator("rloo")
def rloo_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024, "Back to Basics"; Kool et al., 2019): leave-one-out baseline.

    A_i = R_i - (1 / (G - 1)) sum_{j != i} R_j, i.e. G / (G - 1) x (R_i - mean_g R): an unbiased
    baseline, since it does not depend on sample i. No std normalisation: `norm_adv_by_std` and
    `epsilon` are ignored. A group with no spread gets exactly 0.
    """
    rewards_BG = _groups(rewards_B, group_size)
    others_mean_BG = (rewards_BG.sum(dim=1, keepdim=True) - rewards_BG) / (group_size - 1)
    return _zero_where_no_spread(rewards_BG - others_mean_BG, rewards_BG).reshape(-1)


def _batch_whiten(x_B: torch.Tensor, norm_adv_by_std: bool, epsilon: float) -> torch.Tensor:
    assert x_B.numel() >= 2, "batch-normalised advantages need at least two sequences"
    centered_B = x_B - x_B.mean()
    if norm_adv_by_std:
        centered_B = centered_B / (x_B.std(unbiased=True) + epsilon)
    if x_B.amax() == x_B.amin():  # no spread in the whole batch: exactly 0 (see _zero_where_no_spread)
        centered_B = torch.zeros_like(centered_B)
    return centered_B


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025, arXiv 2501.03262), outcome rewards: normalised over the whole batch.

    A = (R - mean_batch R) / (std_batch R + epsilon), unbiased std; no groups (`group_size` is unused),
    so a prompt whose samples all score the same still gets a non-zero advantage when the batch
    varies. `norm_adv_by_std=False` only centres. verl whitens over tokens (longer responses weigh
    more); here each sequence counts once (docs/algorithms.md).
    """
    return _batch_whiten(rewards_B.float().reshape(-1), norm_adv_by_std, epsilon)


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6
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


# ----------------------------------------------------------------------------------- policy losses


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


class PolicyLossFn(Protocol):
    """Per-token policy loss: the shared clip settings always, the loss's own `params` by name."""

    def __call__(
        self,
        logp_BT: torch.Tensor,
        old_logp_BT: torch.Tensor,
        adv_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        *,
        clip_ratio_low: float,
        clip_ratio_high: float,
        clip_ratio_c: float | None = None,
        **params: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


LossAndStats = tuple[Tensor, dict[str, Tensor]]  # per-token loss [B, T] and masked-mean statistics

# Settings every policy loss is called with (keyword arguments of `PolicyLossFn`), and the shared
# settings a loss may prefer a default for (`LossSpec.defaults`; the config fills them when unset).
SHARED_LOSS_KWARGS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
LOSS_PREFERENCES = ("clip_ratio_low", "clip_ratio_high", "loss_agg_mode")


@dataclass(frozen=True)
class Param:
    """One hyperparameter of a policy loss: its default, its valid range and one line that says what it does.

    The type is the default's (a float accepts an int). `ge` / `gt` / `le` / `lt` bound it as pydantic's
    Field does; the config checks `algorithm.policy_loss_args` against them before the run starts.
    """

    default: float | int | bool | str
    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def range_text(self, name: str) -> str:
        """`0 < scale <= 10`, or `any value` when unbounded."""
        lower = f"{self.ge} <= " if self.ge is not None else f"{self.gt} < " if self.gt is not None else ""
        upper = f" <= {self.le}" if self.le is not None else f" < {self.lt}" if self.lt is not None else ""
        return f"{lower}{name}{upper}" if lower or upper else "any value"


@dataclass(frozen=True)
class LossSpec:
    """What a policy loss declares with its registration: its own hyperparameters (`params`, passed to it as
    keyword arguments from `algorithm.policy_loss_args`) and the values it prefers for shared settings left
    unset (`defaults`, keys from LOSS_PREFERENCES); an explicit setting always wins."""

    params: Mapping[str, Param] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clash = sorted(set(self.params) & set(SHARED_LOSS_KWARGS))
        if clash:
            raise ValueError(
                f"policy loss params {clash} clash with the shared settings {list(SHARED_LOSS_KWARGS)}, which every "
                "loss receives already. Fix: rename them, or prefer a default for a shared setting with `defaults`."
            )
        unknown = sorted(set(self.defaults) - set(LOSS_PREFERENCES))
        if unknown:
            raise ValueError(
                f"a policy loss may prefer defaults for {list(LOSS_PREFERENCES)} only, not {unknown}. Fix: declare "
                "the loss's own hyperparameters as `params`."
            )


POLICY_LOSSES: dict[str, PolicyLossFn] = {}
DEFAULT_POLICY_LOSS = "vanilla"  # the config's default for algorithm.policy_loss


def declare_policy_loss(
    *, params: Mapping[str, Param] | None = None, defaults: Mapping[str, Any] | None = None
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Attach a `LossSpec` to a policy loss without registering a name (decorator).

    For a user's loss named 'package.module:function' in `algorithm.policy_loss`; docs/algorithms.md,
    "Writing your own loss", has a complete example.
    """
    spec = LossSpec(dict(params or {}), dict(defaults or {}))

    def deco(fn):
        fn.loss_spec = spec
        return fn

    return deco


def register_policy_loss(
    name: str, *, params: Mapping[str, Param] | None = None, defaults: Mapping[str, Any] | None = None
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a per-token policy loss under `name` with its hyperparameters and preferred defaults (decorator)."""
    declare, register = declare_policy_loss(params=params, defaults=defaults), _register_into(POLICY_LOSSES, "policy loss", name)
    return lambda fn: register(declare(fn))


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`, or the user's 'package.module:function'.

    A ValueError lists the valid names, or says why the user's function could not be loaded.
    """
    if ":" not in name:
        return _lookup(POLICY_LOSSES, "policy loss", name)
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"policy loss '{name}' could not be loaded ({type(exc).__name__}: {exc}). A user loss is named "
            "'package.module:function' and the module must be importable from the current environment (install the "
            "package, or add its directory to PYTHONPATH)."
        ) from None
    if not callable(fn):
        raise ValueError(f"policy loss '{name}' is a {type(fn).__name__}, not a function. Fix: name a function.")
    return fn


def policy_loss_spec(fn: PolicyLossFn) -> LossSpec:
    """What `fn` declares (`declare_policy_loss` / `register_policy_loss`); a plain function declares nothing."""
    return getattr(fn, "loss_spec", None) or LossSpec()


def _clipped_surrogate(
    ratio_BT: torch.Tensor, adv_BT: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and where the clipped term is the active one."""
    loss_unclipped_BT = -adv_BT * ratio_BT
    loss_clipped_BT = -adv_BT * torch.clamp(ratio_BT, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(loss_unclipped_BT, loss_clipped_BT), loss_clipped_BT > loss_unclipped_BT


def _loss_stats(
    clipped_BT: torch.Tensor, lower_BT: torch.Tensor, log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Masked-mean stats of a policy loss: pg_clipfrac, pg_clipfrac_lower, ppo_kl (mean logp_old - logp)."""
    return {
        "pg_clipfrac": masked_mean(clipped_BT.to(mask_BT.dtype), mask_BT).detach(),
        "pg_clipfrac_lower": masked_mean(lower_BT.to(mask_BT.dtype), mask_BT).detach(),
        "ppo_kl": masked_mean(-log_ratio_BT, mask_BT).detach(),
    }


@register_policy_loss("vanilla")
def policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                clip_ratio_high: float, clip_ratio_c: float | None = None) -> LossAndStats:
    """PPO's per-token clipped surrogate (Schulman et al., 2017) with clip-higher (DAPO) and dual clip.

    r = exp(clamp(logp - logp_old, -20, 20))
    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); for A < 0 with c set: l = min(l, -A c).
    Returns the per-token loss [B, T] (to be aggregated) and masked-mean stats over this batch:
    pg_clipfrac (clipped term active), pg_clipfrac_lower (dual clip active), ppo_kl (mean logp_old - logp).
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = torch.clamp(logp_BT - old_logp_BT, -20.0, 20.0)
    loss_BT, clipped_BT = _clipped_surrogate(torch.exp(log_ratio_BT), adv_BT, clip_ratio_low, clip_ratio_high)
    lower_BT = torch.zeros_like(loss_BT)
    if clip_ratio_c is not None:
        assert clip_ratio_c > 1.0, f"clip_ratio_c must be > 1, got {clip_ratio_c}"
        dual_BT = -adv_BT * clip_ratio_c
        lower_BT = (adv_BT < 0) & (loss_BT > dual_BT)
        loss_BT = torch.where(adv_BT < 0, torch.minimum(loss_BT, dual_BT), loss_BT)
    return loss_BT, _loss_stats(clipped_BT, lower_BT, log_ratio_BT, mask_BT)


@register_policy_loss(
    "gspo", defaults={"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}
)
def gspo_policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                     clip_ratio_high: float, clip_ratio_c: float | None = None) -> LossAndStats:
    """GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): one clipped ratio per sequence.

    s_i  = exp((1 / |y_i|) sum_t m_t (logp_t - logp_old_t))      (length-normalised sequence ratio)
    s_it = sg(s_i) x exp(logp_t - sg(logp_t))                    (value s_i, gradient s_i d logp_t)
    l_it = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))
    A whole sequence is clipped or not, so token-level noise in the ratio no longer decides which
    tokens learn. The paper's ranges are tiny (eps_low 3e-4, eps_high 4e-4) and its aggregation is
    seq-mean-token-mean (declared as its preferred defaults). The mean log-ratio is clamped to [-20, 20].
    `clip_ratio_c` is ignored (the paper has no dual clip), so pg_clipfrac_lower is 0; the loss is not
    bounded by the clip range: for A < 0 and s_i > 1 + eps_high the unclipped term -A s_i is the larger,
    so the loss grows with s_i and the gradient flows, as in PPO without dual clip. pg_clipfrac counts
    tokens of clipped sequences.
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = torch.clamp(logp_BT - old_logp_BT, -20.0, 20.0)
    seq_log_ratio_B = (log_ratio_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    seq_log_ratio_B = torch.clamp(seq_log_ratio_B, -20.0, 20.0).detach()
    ratio_BT = torch.exp(logp_BT - logp_BT.detach() + seq_log_ratio_B[:, None])  # [B, T], s_i on every token
    loss_BT, clipped_BT = _clipped_surrogate(ratio_BT, adv_BT, clip_ratio_low, clip_ratio_high)
    return loss_BT, _loss_stats(clipped_BT, torch.zeros_like(loss_BT), log_ratio_BT, mask_BT)


@register_policy_loss("cispo", defaults={"loss_agg_mode": "token-mean"})
def cispo_policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *, clip_ratio_low: float,
                      clip_ratio_high: float, clip_ratio_c: float | None = None) -> LossAndStats:
    """CISPO (MiniMax, 2025, "MiniMax-M1", arXiv 2506.13585, eq. 4): clip the IS weight, not the update.

    r = exp(clamp(logp - logp_old, -20, 20)),  w = sg(clip(r, 1 - eps_low, 1 + eps_high))
    l = -w A logp
    Its gradient is -w A d logp: the importance-weighted policy gradient with a truncated weight.
    Unlike PPO's clip, which zeroes the gradient of tokens whose ratio left the range (often rare
    "fork" tokens such as "Wait"), every token keeps contributing, with a bounded weight. On-policy
    (r = 1) the gradient equals the vanilla loss's. The paper imposes no lower bound (a large
    eps_low; here clip_ratio_low close to 1) and tunes eps_high only; it aggregates token-mean.
    The loss value is not a surrogate objective (it is -w A logp); its gradient is what counts.
    `clip_ratio_c` is ignored (w is already bounded); pg_clipfrac counts tokens whose weight was
    truncated, on either side; pg_clipfrac_lower is 0.
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = torch.clamp(logp_BT - old_logp_BT, -20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT).detach()
    weight_BT = torch.clamp(ratio_BT, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_BT = -weight_BT * adv_BT * logp_BT
    truncated_BT = (ratio_BT > 1.0 + clip_ratio_high) | (ratio_BT < 1.0 - clip_ratio_low)
    return loss_BT, _loss_stats(truncated_BT, torch.zeros_like(loss_BT), log_ratio_BT, mask_BT)


# ----------------------------------------------------------------------------- rollout correction


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


# ---------------------------------------------------------------------------------- aggregation


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
    return _lookup(KL_ESTIMATORS, "KL estimator", estimator)(ref_logp_BT - logp_BT)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per position: logsumexp(z) - sum(softmax(z) z). Pass scaled logits."""
    logits_BTV = logits_BTV.float()
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs_BTV * logits_BTV).sum(-1)


# ------------------------------------------------------------------------------ token log-probs
class _TokenLogprobs(torch.autograd.Function):
    """Log-prob of each target and the entropy, from logits, in fp32 chunks of tokens.

    With s = z / temperature and lse = logsumexp(s): logp = s[y] - lse, H = lse - sum(softmax(s) s).
    Backward (per token, p = softmax(s)): dlogp/ds = onehot(y) - p, dH/ds = -p (s - sum(p s)), both
    divided by the temperature for dz. Only the logits (the model's output, any dtype), lse and
    sum(p s) are kept for backward; each chunk's fp32 softmax is recomputed there. So at most
    [chunk, V] fp32 exists at a time, forward or backward, where autograd through log_softmax
    would keep several [N, V] fp32 copies alive until backward.
    """

    @staticmethod
    def forward(ctx, logits_NV: Tensor, targets_N: Tensor, temperature: float, chunk: int, with_entropy: bool):
        N = logits_NV.shape[0]
        fp = torch.promote_types(logits_NV.dtype, torch.float32)  # fp32, or fp64 for fp64 logits
        logp_N = torch.empty(N, dtype=fp, device=logits_NV.device)
        lse_N = torch.empty_like(logp_N)
        mean_s_N = torch.empty_like(logp_N)  # sum(p s): the expected scaled logit
        for lo in range(0, N, chunk):
            s_CV = logits_NV[lo : lo + chunk].to(fp) / temperature
            lse_C = torch.logsumexp(s_CV, dim=-1)
            lse_N[lo : lo + chunk] = lse_C
            logp_N[lo : lo + chunk] = s_CV.gather(-1, targets_N[lo : lo + chunk, None]).squeeze(-1) - lse_C
            if with_entropy:
                mean_s_N[lo : lo + chunk] = (torch.softmax(s_CV, dim=-1) * s_CV).sum(-1)
        entropy_N = lse_N - mean_s_N if with_entropy else torch.zeros_like(logp_N)
        ctx.save_for_backward(logits_NV, targets_N, lse_N, mean_s_N)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.mark_non_differentiable(targets_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N: Tensor, grad_entropy_N: Tensor):
        logits_NV, targets_N, lse_N, mean_s_N = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad_NV = torch.empty_like(logits_NV)
        for lo in range(0, logits_NV.shape[0], chunk):
            hi = lo + chunk
            s_CV = logits_NV[lo:hi].to(lse_N.dtype) / tau
            p_CV = torch.exp(s_CV - lse_N[lo:hi, None])
            g_CV = -grad_logp_N[lo:hi, None] * p_CV  # logp part: onehot(y) - p
            y_C1 = targets_N[lo:hi, None]
            g_CV.scatter_(-1, y_C1, g_CV.gather(-1, y_C1) + grad_logp_N[lo:hi, None])  # one target per row
            if ctx.with_entropy:
                g_CV -= grad_entropy_N[lo:hi, None] * p_CV * (s_CV - mean_s_N[lo:hi, None])
            grad_NV[lo:hi] = g_CV / tau
        return grad_NV, None, None, None, None


def token_logprobs(
    logits_NV: Tensor, targets_N: Tensor, temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(log softmax(z / temperature)[target], entropy or None) per token in fp32 (fp64 for fp64), from logits [N, V].

    Computed in chunks of `chunk_tokens` rows (`_TokenLogprobs`), so [N, V] is never materialised in
    fp32 at once; the result does not depend on the chunk size beyond float rounding.
    """
    assert chunk_tokens >= 1, "chunk_tokens must be positive"
    logp_N, entropy_N = _TokenLogprobs.apply(logits_NV, targets_N, float(temperature), int(chunk_tokens), with_entropy)
    return logp_N, entropy_N if with_entropy else None
