"""Format rewards: the R1 think/answer layout (format) and geo3k's accuracy + format mix (geo3k).

- `format` (alias `strict_format`): 1.0 when the completion is exactly
  `<think> ... </think> <answer> ... </answer>` (whitespace around and between the blocks allowed,
  each tag once), else 0.0. A format reward, not an accuracy: it never drives dynamic sampling
  when an accuracy verifier is also listed.
- `geo3k`: 0.9 x accuracy + 0.1 x format, as verl's geo3k reward. Accuracy is the boxed-answer
  check of `math_17k_acc`; format means `<think>...</think>` first, then a `\\boxed{...}` after it.
  Metrics: acc and format.

Implemented with `str.find`, not regexes, so the cost is linear even on a 1 MB completion.
"""

from __future__ import annotations

from postrl.rewards.equivalence import math_equal, quick_equal
from postrl.rewards.verdict import VerifierResult, register
from postrl.rewards.text import last_boxed, matching_brace

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_answer_ok(completion: str) -> bool:
    """`<think>...</think>` then `<answer>...</answer>` and nothing else (each tag exactly once)."""
    s = completion.strip()
    if not (s.startswith("<think>") and s.endswith("</answer>")):
        return False
    if any(s.count(tag) != 1 for tag in _TAGS):
        return False
    close_think, open_answer = s.find("</think>"), s.find("<answer>")
    return close_think < open_answer and not s[close_think + len("</think>") : open_answer].strip()


@register("format", "strict_format", in_process=True, accuracy=False, uses_row=False)
def think_answer_format(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """1.0 for the `<think>...</think><answer>...</answer>` layout, else 0.0."""
    ok = think_answer_ok(completion)
    return VerifierResult(float(ok), {"acc": float(ok), "format": float(ok)})


def think_boxed_ok(completion: str) -> bool:
    """geo3k's layout: starts with `<think>`, has `</think>`, then a closed `\\boxed{...}` after it."""
    s = completion.strip()
    if not s.startswith("<think>"):
        return False
    end_think = s.rfind("</think>")
    if end_think < 0:
        return False
    box = s.find("\\boxed{", end_think)
    return box >= 0 and matching_brace(s, box + len("\\boxed")) >= 0


GEO3K_FORMAT_WEIGHT = 0.1


def _geo3k(acc: bool, completion: str) -> VerifierResult:
    fmt = think_boxed_ok(completion)
    score = (1 - GEO3K_FORMAT_WEIGHT) * float(acc) + GEO3K_FORMAT_WEIGHT * float(fmt)
    return VerifierResult(score, {"acc": float(acc), "format": float(fmt)})


def _geo3k_fast(completion: str, ground_truth: str, row: dict) -> VerifierResult | None:
    verdict = quick_equal(last_boxed(completion), ground_truth)
    return None if verdict is None else _geo3k(verdict, completion)


@register("geo3k", fast=_geo3k_fast, uses_row=False)
def geo3k(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """0.9 x (last \\boxed{} equals the ground truth) + 0.1 x (think-then-boxed layout)."""
    return _geo3k(math_equal(last_boxed(completion), ground_truth), completion)
