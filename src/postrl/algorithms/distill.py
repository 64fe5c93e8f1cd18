"""On-policy distillation: a teacher scores the student's own samples, token by token (docs/algorithms.md).

The student S samples y as in RL; a frozen teacher T scores the same tokens. Two variants:

- sampled-token (`top_k: 0`, Thinking Machines' / tinker-cookbook's on-policy distillation): the per-token
  advantage is the negative single-sample reverse KL,

      A_t = -(log S(y_t | x, y_<t) - log T(y_t | x, y_<t)),   detached,

  with log S the old (proximal) log-probs, and `reward_weight` w mixes in the group advantage:
  A_t + w A_group. It goes through the usual clipped policy loss, so its gradient on-policy (ratio 1) is
  -A_t d log S(y_t) per token: the REINFORCE estimate of the reverse KL's gradient with each token's own
  term as its return (no credit to earlier tokens, as in the cookbook: discount 0).

- top-k (`top_k: k`): at every position the teacher's k most likely tokens K_t, both distributions
  renormalised over K_t (S~ = softmax(s_K), T~ = softmax(t_K) with s, t the temperature-scaled logits), and
  the exact reverse KL over them,

      KL_t = sum_{v in K_t} S~(v) (log S~(v) - log T~(v)),
      dKL_t / ds_v = S~(v) (log S~(v) - log T~(v) - KL_t)   for v in K_t,  0 elsewhere

  (divide by the temperature for the raw logits). It is a loss in its own right (no ratio, no clip),
  aggregated with `loss_agg_mode` over the loss mask like the KL-to-reference term, and added to the
  policy loss, whose advantage is then w A_group alone (w = 0: the top-k KL is the whole objective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.algorithms.common import masked_mean


def distill_advantages(old_logp_BT: Tensor, teacher_logp_BT: Tensor, adv_BT: Tensor, reward_weight: float) -> Tensor:
    """A_t = -(log S - log T) + w A_group, detached; [B, T] like the inputs (the mask is applied by the loss)."""
    return (teacher_logp_BT - old_logp_BT).detach() + reward_weight * adv_BT


def topk_reverse_kl(student_topk_logits_BTK: Tensor, teacher_topk_logp_BTK: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(S~ || T~) per position [B, T] over the teacher's top-k tokens, both renormalised over them.

    student_topk_logits_BTK: the student's raw logits at the teacher's top-k ids (differentiable);
    teacher_topk_logp_BTK: the teacher's log-probs at those ids (any normalisation: renormalised here).
    """
    log_s = torch.log_softmax(student_topk_logits_BTK.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_topk_logp_BTK.float().detach(), dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1)


def distill_stats(
    old_logp_BT: Tensor, teacher_logp_BT: Tensor, sampled_ids_BT: Tensor, teacher_top1_BT: Tensor, mask_BT: Tensor
) -> dict[str, Tensor]:
    """distill/reverse_kl (the sampled-token estimate, mean of log S - log T), distill/teacher_logprob_mean and
    distill/top1_agreement (share of tokens where the teacher's most likely token is the sampled one), over the
    loss mask."""
    return {
        "distill/reverse_kl": masked_mean((old_logp_BT - teacher_logp_BT).detach(), mask_BT),
        "distill/teacher_logprob_mean": masked_mean(teacher_logp_BT, mask_BT),
        "distill/top1_agreement": masked_mean((teacher_top1_BT == sampled_ids_BT).float(), mask_BT),
    }
