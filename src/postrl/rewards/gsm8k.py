"""GSM8K verifiers: the number after `####` (strict) or the last number in the text (flexible).

- `gsm8k` (alias `gsm8k_strict`): the completion must state its answer as `#### <number>` (the
  last such line counts), as GSM8K's reference solutions do; this also rewards the format.
- `gsm8k_flexible`: the last number anywhere in the completion.

Numbers are compared as numbers: `$1,600`, `1600` and `1600.00` are equal. The ground truth may be
the bare number or a whole reference solution ending in `#### <number>`. Score and acc 1/0.
"""

from __future__ import annotations

import re
from decimal import Decimal

from postrl.rewards.verdict import VerifierResult, register
from postrl.rewards.text import numbers_equal, parse_number

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(?:\$\s*)?(" + _NUMBER + ")")  # one way to read the spaces: no backtracking
_ANY_NUMBER = re.compile(_NUMBER)


def _to_number(s: str) -> Decimal | None:
    return parse_number(s.rstrip("."))


def extract_strict(text: str) -> Decimal | None:
    """The number of the last `#### <number>` in `text`, or None."""
    found = _STRICT.findall(text)
    return _to_number(found[-1]) if found else None


def extract_flexible(text: str) -> Decimal | None:
    """The last number in `text`, or None."""
    found = _ANY_NUMBER.findall(text)
    for s in reversed(found):
        num = _to_number(s)
        if num is not None:
            return num
    return None


def ground_truth_number(ground_truth: str) -> Decimal | None:
    """A bare number, or the `####` number of a full reference solution."""
    num = _to_number(ground_truth.strip())
    if num is None and "####" in ground_truth:
        num = extract_strict(ground_truth)
    return num


def _score(pred: Decimal | None, ground_truth: str) -> VerifierResult:
    truth = ground_truth_number(ground_truth)
    ok = pred is not None and truth is not None and numbers_equal(pred, truth)
    return VerifierResult(float(ok), {"acc": float(ok)})


@register("gsm8k", "gsm8k_strict", in_process=True, uses_row=False)
def gsm8k_strict(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """1.0 when the last `#### <number>` of the completion equals the ground truth."""
    return _score(extract_strict(completion), ground_truth)


@register("gsm8k_flexible", in_process=True, uses_row=False)
def gsm8k_flexible(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """1.0 when the last number of the completion equals the ground truth."""
    return _score(extract_flexible(completion), ground_truth)
