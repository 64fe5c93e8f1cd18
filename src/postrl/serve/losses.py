"""Tinker's built-in losses, as postrl's own formulas (postrl.algorithms): the service adds no math of its own.

Per datum, with logp_T the trainer's log-probs of `target_tokens` (algorithms.token_logprobs), Tinker's
definitions, each a plain sum over the datum's tokens (Tinker does not normalise; the caller weighs tokens
through `weights` / `advantages`):

    cross_entropy        sum_t -w_t logp_t                                   (weights)
    importance_sampling  sum_t -A_t exp(logp_t - q_t)                         (logprobs q, advantages A)
    ppo                  sum_t max(-A_t r_t, -A_t clip(r_t, lo, hi))          (+ clip_low/high_threshold)

importance_sampling is postrl's vanilla policy loss with the clip switched off (clip_ratio_low = high = inf);
ppo is the same loss with clip_ratio_low = 1 - lo and clip_ratio_high = hi - 1 (defaults 0.8 / 1.2, Tinker's).
The sum is postrl's `seq-mean-token-sum` aggregation over one sequence. Both policy losses clamp the log-ratio
to [-20, 20] (DESIGN.md section 4), where Tinker's do not: they agree wherever exp stays finite.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from postrl import algorithms as algo
from postrl.errors import UserError


def _sum(loss_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    return algo.aggregate_loss(loss_T[None], mask_T[None], "seq-mean-token-sum", num_seqs=1.0)


def cross_entropy(logp_T: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    return _sum(-logp_T, inputs["weights"].to(logp_T.dtype))


def _policy(logp_T, inputs, clip_low: float, clip_high: float) -> torch.Tensor:
    loss_BT, _ = algo.get_policy_loss_fn("vanilla")(
        logp_T[None], inputs["logprobs"].to(logp_T.dtype)[None], inputs["advantages"].to(logp_T.dtype)[None],
        torch.ones_like(logp_T)[None], clip_ratio_low=clip_low, clip_ratio_high=clip_high,
    )  # fmt: skip
    return _sum(loss_BT[0], torch.ones_like(logp_T))


def importance_sampling(logp_T: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    return _policy(logp_T, inputs, math.inf, math.inf)


def ppo(logp_T: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if not 0.0 <= lo <= 1.0 <= hi:
        raise UserError(f"ppo: loss_fn_config needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {lo}, {hi}")
    return _policy(logp_T, inputs, 1.0 - lo, hi - 1.0)


LossFn = Callable[[torch.Tensor, dict, dict], torch.Tensor]
# name -> (the loss, the loss_fn_inputs it reads besides target_tokens)
LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages")),
    "ppo": (ppo, ("logprobs", "advantages")),
}


def get_loss(name: str) -> tuple[LossFn, tuple[str, ...]]:
    if name not in LOSSES:
        raise UserError(
            f"loss_fn '{name}' is not served here; this server computes {', '.join(LOSSES)} (postrl's formulas). "
            "cispo, dro, gspo, stable_reinforce and custom losses are Tinker's own and are not reproduced."
        )
    return LOSSES[name]
