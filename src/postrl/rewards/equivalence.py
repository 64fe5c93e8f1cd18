"""Is a predicted answer equal to the ground truth? A cheap verdict first, math-verify second.

`quick_equal` decides the easy cases in microseconds (same canonical string, two plain numbers,
an absurdly long answer). `math_equal` asks math-verify (sympy underneath), which knows that
`\\frac{1}{2}`, `0.5` and `\\dfrac12` are the same number but can take unbounded time on inputs such
as `9^{9^{9^{9}}}`. `completion_matches` lets math-verify also find the answer in a whole
completion. The reward function therefore calls `math_equal` and `completion_matches` only inside
the worker pool of `postrl.rewards.pool`, which enforces a hard per-call time limit.
"""

from __future__ import annotations

import logging
import threading

from postrl.rewards.text import last_boxed, normalize_math, numbers_equal, parse_number, simple_value
from postrl.untrusted import MAX_MATH_DEPTH, REWARD_UNREADABLE, bracket_depth, exact_value, trip

# A final answer longer than this (and longer than 20x the ground truth) is not worth a symbolic
# check: it is scored wrong unless it matches the ground truth as a string.
MAX_ANSWER_CHARS = 1000

# math-verify's own time limit uses SIGALRM: it works only in the main thread and swallows the
# time-out as "not equal". Inside the pool's workers it is switched off (the pool enforces the limit
# and counts time-outs); elsewhere it is a last line of defence for direct calls.
_signal_timeout_s: int | None = 5


def disable_signal_timeout() -> None:
    """Called once in each pool worker, where the pool's own time limit applies."""
    global _signal_timeout_s
    _signal_timeout_s = None
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def unbox(truth: str) -> str:
    """A ground truth stored as `\\boxed{5}` (some data sets do) is compared by its content."""
    if "\\boxed" in truth or "\\fbox" in truth:
        inner = last_boxed(truth)
        if inner is not None:
            return inner
    return truth


def quick_equal(pred: str | None, truth: str) -> bool | None:
    """True/False when the answer can be decided by string or number comparison, else None.

    Bounded in time and memory on any input (it runs in the trainer's process): linear string work, and
    numbers compared without being expanded. An answer too absurd for a symbolic check (longer than
    MAX_ANSWER_CHARS and 20x the ground truth, or a number past `untrusted.MAX_EXPONENT` against a
    ground truth that is no number) is scored wrong unless it matched as a string or a number, counted in
    reward/unreadable."""
    if pred is None:
        return False
    truth = unbox(truth)
    p, t = normalize_math(pred), normalize_math(truth)
    if not p:
        return False
    if p == t:
        return True
    pn, tn = parse_number(p), parse_number(t)
    if pn is not None and tn is not None:
        return numbers_equal(pn, tn)
    if pn is not None and exact_value(pn) is None:
        trip(REWARD_UNREADABLE)  # 1e999999999 against a formula: symbolically, sympy would expand it
        return False
    pv, tv = simple_value(p), simple_value(t)
    if pv is not None and tv is not None:
        if pv[0] == tv[0]:
            return True
        if not (pv[1] or tv[1]):
            return False  # two exact values that differ; a decimal may be a rounding: ask math-verify
    if len(pred) > max(MAX_ANSWER_CHARS, 20 * len(truth)) or too_deep(pred):
        trip(REWARD_UNREADABLE)
        return False
    return None


def too_deep(text: str) -> bool:
    """Brackets nested past `MAX_MATH_DEPTH`: math-verify's LaTeX parser would spend seconds a sample on them
    (a \\boxed{ of 5000 `[` took 48 s), so such text is scored wrong, counted, before it is parsed."""
    return bracket_depth(text) > MAX_MATH_DEPTH


def _timeout() -> int | None:
    """math-verify's own (SIGALRM) time limit: only in the main thread, and not inside pool workers."""
    return _signal_timeout_s if threading.current_thread() is threading.main_thread() else None


def _parse(answer: str) -> list:
    from math_verify import parse

    timeout = _timeout()
    # Wrapping in \boxed{} makes math-verify read the whole string as one LaTeX answer.
    parsed = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
    if not parsed:
        parsed = parse(answer, parsing_timeout=timeout)
    return parsed


def math_equal(pred: str | None, truth: str) -> bool:
    """Symbolic equivalence through math-verify; unparseable answers are not equal.

    Unbounded in time on adversarial input: call it through the verifier pool.
    """
    verdict = quick_equal(pred, truth)
    if verdict is not None:
        return verdict
    from math_verify import verify

    truth = unbox(truth)
    gold, target = _parse(truth), _parse(pred or "")
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=_timeout()))


def completion_matches(completion: str, truth: str) -> bool:
    """math-verify end to end: does the answer it finds in the whole completion equal the ground truth?

    The completion goes through `math_verify.parse` with its default extraction (LatexExtractionConfig
    + ExprExtractionConfig): `\\boxed{}`, "the final answer is $X$", "The answer is: X", "Answer: X",
    else the last formula or number ("#### X" included). The ground truth is read as one answer (a
    stored `\\boxed{}` unwrapped; a GSM8K solution by its `#### ` number). Unbounded in time on
    adversarial input: call it through the verifier pool.
    """
    from math_verify import parse, verify

    truth = unbox(truth)
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1].strip()
    gold = _parse(truth)
    if not gold:
        return False
    if too_deep(completion):
        trip(REWARD_UNREADABLE)
        return False
    target = parse(completion, parsing_timeout=_timeout())
    return bool(target) and bool(verify(gold, target, timeout_seconds=_timeout()))
