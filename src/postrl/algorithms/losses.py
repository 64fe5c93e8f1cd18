"""Per-token policy losses by name, each declaring its hyperparameters and preferred settings (docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import Tensor
from postrl.algorithms.common import _lookup, _register_into, masked_mean
from postrl.utils import import_named


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
    return import_named(name, f"policy loss '{name}'")


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


def value_loss(values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, *, cliprange_value: float) -> LossAndStats:
    """PPO's clipped value loss per token: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

    Aggregate it like the policy loss (`aggregate_loss`). vf_clipfrac: the share of model tokens where
    the clipped term is the larger one (verl's critic/vf_clipfrac).
    """
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-cliprange_value, cliprange_value)
    unclipped_sq_BT = (values_BT - returns_BT).square()
    clipped_sq_BT = (clipped_BT - returns_BT).square()
    loss_BT = 0.5 * torch.maximum(unclipped_sq_BT, clipped_sq_BT)
    return loss_BT, {"critic/vf_clipfrac": masked_mean((clipped_sq_BT > unclipped_sq_BT).float(), mask_BT)}
