"""On-policy distillation's terms in the update: what each micro-step of the actor adds (issue 37).

The teacher's pass (postrl/held/teacher.py, `score`) leaves TEACHER_KEYS in the packed rows; in each
micro-step `Distiller.terms` turns them into a per-token advantage, or the top-k KL loss, and distill/* stats.
The formulas are pure functions in algorithms/distill.py; docs/algorithms.md explains the method.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from postrl.algorithms.common import masked_mean
from postrl.algorithms.distill import distill_advantages, distill_stats, topk_reverse_kl

TEACHER_KEYS = ("teacher_logp", "teacher_top1", "teacher_topk_logp", "teacher_topk_ids")  # [B, T] / [B, T, K] tensors


def _logits_at(ids_BTK: torch.Tensor) -> Callable:
    """logits_fn for the student's update forward: its logits at the teacher's top-k ids (differentiable)."""
    return lambda logits_MV, b_M, k_M: logits_MV.gather(1, ids_BTK[b_M, k_M])


class Distiller:
    """The distillation terms of one micro-batch (actor._micro_step), bound to the distill settings."""

    def __init__(self, cfg: Any):
        self.reward_weight = cfg.distill.reward_weight
        self.top_k = cfg.distill.top_k
        self.temperature = cfg.rollout.temperature

    def logits_fn(self, mb: dict) -> Callable | None:
        """What the update forward must also return: the logits at the teacher's top-k ids (top-k variant)."""
        return _logits_at(mb["teacher_topk_ids"]) if self.top_k else None

    def terms(self, mb: dict, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor, student_topk_BTK: torch.Tensor | None, mask_BT: torch.Tensor):
        """(advantage [B, T] for the policy loss, extra per-token loss [B, T] or None, distill/* stats)."""
        teacher_logp = mb["teacher_logp"]
        sampled = mb["input_ids"][:, -teacher_logp.shape[1] :]  # responses are the last T columns
        stats = distill_stats(old_logp_BT, teacher_logp, sampled, mb["teacher_top1"], mask_BT)
        if not self.top_k:
            return distill_advantages(old_logp_BT, teacher_logp, adv_BT, self.reward_weight), None, stats
        kl_BT = topk_reverse_kl(student_topk_BTK, mb["teacher_topk_logp"], self.temperature)
        stats["distill/topk_kl"] = masked_mean(kl_BT.detach(), mask_BT)
        stats["distill/teacher_topk_mass"] = masked_mean(mb["teacher_topk_logp"].exp().sum(-1), mask_BT)
        return self.reward_weight * adv_BT, kl_BT, stats
