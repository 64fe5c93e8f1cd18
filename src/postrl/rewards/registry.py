"""Verifier registry and the weighted reward.

A verifier is a plain function `(completion: str, ground_truth: str, row: dict) -> VerifierResult`
(a bare float is accepted too). Built-ins register themselves by name with `@register("name")`;
users name their own as `package.module:function` in `reward.verifiers`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from postrl.config import RewardConfig


@dataclass
class VerifierResult:
    """A verifier's verdict: the reward `score` and named metrics (at least `acc`, 1.0 or 0.0)."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


Verifier = Callable[[str, str, dict], "VerifierResult | float"]
_REGISTRY: dict[str, Verifier] = {}


def register(name: str) -> Callable[[Verifier], Verifier]:
    """Register a verifier under `name` (decorator)."""

    def deco(fn: Verifier) -> Verifier:
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_verifiers() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    import postrl.rewards.math  # noqa: F401  (registers the built-in verifiers)


def get_verifier(name: str) -> Verifier:
    """Resolve a registered name or a `package.module:function` path."""
    from postrl.errors import UserError

    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise UserError(
                f"verifier '{name}' could not be loaded ({exc}). A user verifier is named "
                "'package.module:function' and the module must be importable from the current environment."
            ) from exc
        return fn
    raise UserError(
        f"unknown verifier '{name}'. Registered verifiers: {', '.join(registered_verifiers())}; "
        "or name your own function as 'package.module:function'."
    )


def to_result(value: "VerifierResult | float") -> VerifierResult:
    if isinstance(value, VerifierResult):
        return value
    score = float(value)
    return VerifierResult(score, {"acc": float(score > 0)})


@dataclass
class RewardOutput:
    """Scores of a batch of completions.

    `scores[i]` is the weighted sum over verifiers; `metrics[name][i]` holds per-completion values:
    `acc` (from the first verifier that reports it; dynamic sampling filters on it) and, for each
    verifier, its own score under the verifier's name.
    """

    scores: list[float]
    metrics: dict[str, list[float]]
    timeouts: int = 0


class RewardFunction:
    """The weighted sum of the verifiers listed in `reward.verifiers`."""

    def __init__(self, cfg: "RewardConfig"):
        self.cfg = cfg
        self.verifiers = [(v.name, v.weight, get_verifier(v.name)) for v in cfg.verifiers]

    def __call__(self, completions: list[str], ground_truths: list[str], rows: list[dict]) -> RewardOutput:
        scores = [0.0] * len(completions)
        metrics: dict[str, list[float]] = {name: [] for name, _, _ in self.verifiers}
        acc: list[float | None] = [None] * len(completions)
        for name, weight, fn in self.verifiers:
            for i, (text, gt, row) in enumerate(zip(completions, ground_truths, rows)):
                res = to_result(fn(text, gt, row))
                scores[i] += weight * res.score
                metrics[name].append(res.score)
                if acc[i] is None and "acc" in res.metrics:
                    acc[i] = res.metrics["acc"]
        metrics["acc"] = [a if a is not None else float(s > 0) for a, s in zip(acc, scores)]
        return RewardOutput(scores, metrics)

    def close(self) -> None:
        pass
