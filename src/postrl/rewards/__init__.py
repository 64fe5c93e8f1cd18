"""Rule-based rewards: verifiers registered by name and their weighted combination.

Built-in verifiers (see docs/rewards.md): math_17k_acc (boxed_acc, base_acc), acc_for_dapo (dapo),
math_verify, gsm8k (gsm8k_strict), gsm8k_flexible, geo3k, format (strict_format). Users add their own
as `package.module:function`.
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
