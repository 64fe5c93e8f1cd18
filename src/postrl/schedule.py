"""The learning-rate schedule the RL update (actor.py) and the SFT warm start (sft.py) share."""

from __future__ import annotations

import math
from typing import Callable


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then constant or cosine down to min_ratio (as a LambdaLR factor)."""

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f
