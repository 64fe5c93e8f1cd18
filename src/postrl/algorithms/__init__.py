"""The math of GRPO, DAPO and their relatives as pure tensor functions (docs/algorithms.md).

No I/O and no config objects: every function takes tensors and keyword arguments and returns tensors
(and, for losses, a dict of statistics). Shapes: B sequences, G group size, T response tokens.

Variants are chosen by name from registries, as in verl's core_algos (an unknown name raises a
ValueError that lists the valid ones); this package is the one place that holds the names:
- advantage estimators (`get_adv_estimator`): grpo, drgrpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_seq, reinforce_plus_plus_baseline; one signature `fn(rewards_B, group_size, *, norm_adv_by_std, epsilon,
  num_tokens_B)` (loss tokens per sequence: reinforce_plus_plus whitens over tokens; the others ignore it);
  those that need a value model (`CRITIC_ADV_ESTIMATORS`: gae) are token-level, `fn(token_rewards_BT,
  values_BT, mask_BT, gamma, lam) -> (adv_BT, returns_BT)`, with PPO's clipped `value_loss`;
- policy losses (`get_policy_loss_fn`): vanilla, gspo, cispo, gpg, sapo, geo_mean, clip_cov, kl_cov, or a
  user's 'package.module:function'; one
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
  CISPO (MiniMax-M1, MiniMax, 2025), GPG (Chu et al., 2025), SAPO (Gao et al., 2025), GMPO (Zhao et al.,
  2025), Clip-Cov and KL-Cov (Cui et al., 2025, "The Entropy Mechanism of RL for Reasoning LMs"), truncated / masked importance sampling for the rollout engine's
  mismatch (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training").

Loss aggregation is split in two so that gradients do not depend on micro-batching: the caller
computes the normalisers once for the whole mini-batch (over all ranks) with `loss_normalizers`,
and `aggregate_loss` returns each micro-batch's *share*; the shares add up to the mini-batch loss.

The parts: `advantages.py` (estimators, overlong penalty, group filter), `losses.py` (policy losses
and their declarations), `surrogates.py` (GPG, SAPO, GMPO, Clip-Cov, KL-Cov), `correction.py` (rollout correction levels), `aggregation.py` (loss
aggregation, KL, entropy), `distill.py` (on-policy distillation's per-token advantage and top-k
reverse KL), `mismatch.py` (the engine-vs-trainer gap of each step under verl's names), `logprobs.py`
(per-token log-probs from logits), `common.py` (registries).
"""

from __future__ import annotations

from postrl.algorithms.advantages import (  # noqa: F401
    AdvEstimator,
    ADV_ESTIMATORS,
    register_adv_estimator,
    get_adv_estimator,
    grpo_advantages,
    drgrpo_advantages,
    rloo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_seq_advantages,
    overlong_penalty,
    group_keep_mask,
    CRITIC_ADV_ESTIMATORS,
    gae_advantages,
    needs_critic,
    terminal_rewards,
    masked_whiten,
    whiten_totals,
)
from postrl.algorithms.losses import (  # noqa: F401
    PolicyLossFn,
    LossAndStats,
    SHARED_LOSS_KWARGS,
    LOSS_PREFERENCES,
    Param,
    LossSpec,
    POLICY_LOSSES,
    DEFAULT_POLICY_LOSS,
    declare_policy_loss,
    register_policy_loss,
    get_policy_loss_fn,
    policy_loss_spec,
    policy_loss,
    gspo_policy_loss,
    cispo_policy_loss,
    value_loss,
)
from postrl.algorithms.surrogates import (  # noqa: F401
    gpg_policy_loss,
    sapo_policy_loss,
    geo_mean_policy_loss,
    clip_cov_policy_loss,
    kl_cov_policy_loss,
    token_covariance,
)
from postrl.algorithms.correction import (  # noqa: F401
    RolloutCorrectionFn,
    ROLLOUT_CORRECTIONS,
    register_rollout_correction,
    rollout_correction_rejects,
    rollout_loss_mask,
    rollout_correction,
)
from postrl.algorithms.aggregation import (  # noqa: F401
    loss_normalizers,
    LOSS_AGGREGATIONS,
    aggregate_loss,
    KL_ESTIMATORS,
    kl_penalty,
    entropy_from_logits,
)
from postrl.algorithms.distill import (  # noqa: F401
    distill_advantages,
    topk_reverse_kl,
    distill_stats,
)
from postrl.algorithms.logprobs import (  # noqa: F401
    token_logprobs,
)
from postrl.algorithms.common import (  # noqa: F401
    masked_mean,
)
