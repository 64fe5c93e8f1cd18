"""What a verifier is and what it returns: `VerifierResult`, `to_result` (which refuses a verdict
that is not a finite score with `InvalidVerdict`) and the name registry (`register`).

A leaf module: the built-in verifiers and the worker pool import it, and `registry` (which loads the
built-ins and runs the pool) re-exports it, so no import goes in a circle.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class VerifierResult:
    """A verifier's verdict: the reward `score` and named metrics (at least `acc`, 1.0 or 0.0)."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


Verifier = Callable[[str, str, dict], "VerifierResult | float"]
FastPath = Callable[[str, str, dict], "VerifierResult | None"]


@dataclass(frozen=True)
class VerifierEntry:
    """How the reward function runs a verifier.

    fn:          the full verifier (may be slow: runs in the worker pool unless `in_process`).
    fast:        optional cheap verdict in the calling process; None means "ask `fn`".
    in_process:  `fn` is pure and bounded (string work): always run it in the calling process.
    fail_score:  score given when a call times out or raises (e.g. -1 for DAPO's +1/-1 rule).
    accuracy:    its `acc` metric is an accuracy that dynamic sampling may filter on (False for
                 pure format rewards, so listing `format` first does not change what `acc` means).
    uses_row:    the verifier reads `row`; if not, the row (maybe holding images) is not shipped
                 to the worker processes.
    """

    fn: Verifier
    fast: FastPath | None = None
    in_process: bool = False
    fail_score: float = 0.0
    accuracy: bool = True
    uses_row: bool = True


_REGISTRY: dict[str, VerifierEntry] = {}


def register(
    *names: str,
    fast: FastPath | None = None,
    in_process: bool = False,
    fail_score: float = 0.0,
    accuracy: bool = True,
    uses_row: bool = True,
) -> Callable[[Verifier], Verifier]:
    """Register a verifier under one or more names (decorator); see `VerifierEntry` for the options."""
    assert names, "register() needs at least one name"

    def deco(fn: Verifier) -> Verifier:
        entry = VerifierEntry(fn, fast, in_process, fail_score, accuracy, uses_row)
        for name in names:
            _REGISTRY[name] = entry
        return fn

    return deco


class InvalidVerdict(TypeError):
    """A verifier returned something that is not a score: NaN or infinity, a string, None, a dict
    without a numeric 'score'. Counted as reward/invalid, apart from verifiers that raise."""


def _score(value: Any) -> float:
    if isinstance(value, numbers.Real):  # int, float, bool and numpy scalars
        try:
            score = float(value)
        except OverflowError:  # 2**1024: an int no float holds
            raise InvalidVerdict("score is an integer too large for a float") from None
        if math.isfinite(score):
            return score
        raise InvalidVerdict(f"score {score} is not a finite number")
    raise InvalidVerdict(f"score is a {type(value).__name__} ({value!r:.60}), not a number")


def _metric(value: numbers.Real) -> float:
    """A metric as a float (NaN and inf are kept: metrics may be any float); an int no float holds is NaN."""
    try:
        return float(value)
    except OverflowError:
        return math.nan


def to_result(value: Any) -> VerifierResult:
    """Coerce what a verifier returned (VerifierResult, float, bool, or {"score": ..., ...});
    raises `InvalidVerdict` for anything that is not a finite score."""
    if isinstance(value, VerifierResult):
        _score(value.score)
        return value
    if isinstance(value, dict):
        if "score" not in value:
            raise InvalidVerdict(f"a dict without a 'score' key (keys: {sorted(value)})")
        metrics = {}
        for k, v in value.items():
            if k != "score" and isinstance(v, numbers.Real):
                metrics[k] = _metric(v)
        score = _score(value["score"])
        metrics.setdefault("acc", float(score > 0))
        return VerifierResult(score, metrics)
    score = _score(value)
    return VerifierResult(score, {"acc": float(score > 0)})


