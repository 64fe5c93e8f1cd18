"""Rewards: rule verifiers registered by name and their weighted combination.

Built-in verifiers (see docs/rewards.md): math_17k_acc (boxed_acc, base_acc), acc_for_dapo (dapo),
math_verify, gsm8k (gsm8k_strict), gsm8k_flexible, geo3k, format (strict_format). Users add their own
as `package.module:function`.

Model-based rewards (docs/rewards.md): a reward model (`reward_model.RewardModel`) and an LLM judge
(`judge.Judge`), loaded by `model_rewards.load_model_rewards` and added to the rules by weight.
"""

from postrl.rewards.registry import (
    RewardFunction,
    RewardOutput,
    VerifierEntry,
    VerifierResult,
    get_entry,
    get_verifier,
    register,
    registered_verifiers,
)

__all__ = [
    "RewardFunction",
    "RewardOutput",
    "VerifierEntry",
    "VerifierResult",
    "get_entry",
    "get_verifier",
    "register",
    "registered_verifiers",
]
