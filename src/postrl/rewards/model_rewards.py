"""The model-based rewards a run asks for: `reward.reward_model` and `reward.judge`, loaded once.

Its own module because it needs both scorers, and the judge builds on the reward model's records.
"""

from __future__ import annotations

from typing import Any

import torch

from postrl.rewards.judge import Judge
from postrl.rewards.reward_model import RewardModel


def load_model_rewards(cfg: Any, device: torch.device, runtime: Any = None) -> list:
    """The scorers the run config's `reward.reward_model` and `reward.judge` ask for (none: rule-only).

    The judge runs through a rollout engine built like the policy's (`rollout`, on `runtime`), with its own
    `engine`.
    """
    from postrl.runtime import DTYPES

    scorers: list = []
    rm, judge = cfg.reward.reward_model, cfg.reward.judge
    if rm is not None:
        scorers.append(RewardModel(rm, device, cfg.data.prompt_key, DTYPES[rm.dtype or cfg.model.dtype]))
    if judge is not None:
        scorers.append(Judge(judge, device, cfg.data.prompt_key, cfg, runtime))
    return scorers
