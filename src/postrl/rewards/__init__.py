"""Rule-based rewards: verifiers registered by name and their weighted combination."""

from postrl.rewards.registry import (
    RewardFunction,
    RewardOutput,
    VerifierResult,
    get_verifier,
    register,
    registered_verifiers,
)

__all__ = ["RewardFunction", "RewardOutput", "VerifierResult", "get_verifier", "register", "registered_verifiers"]
