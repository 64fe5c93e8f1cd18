"""Math verifiers: boxed-answer accuracy (math_17k_acc), DAPO's "Answer:" rule (acc_for_dapo), math_verify.

- `math_17k_acc` (aliases `boxed_acc`, `base_acc`): the last `\\boxed{...}` of the completion is
  compared with the ground truth: same canonical string or same number -> decided at once;
  otherwise math-verify decides symbolically (so `\\frac{1}{2}`, `0.5` and `\\dfrac12` match), in a
  worker process under the reward's time limit. Score and acc 1/0.
- `acc_for_dapo`: DAPO's rule (Yu et al. 2025, as verl's math_dapo reward applies it). Only the
  last 300 characters count; the answer is the last `Answer: ...` line (case-insensitive), or, if
  there is none, the last `\\boxed{}` in those characters (postrl's addition: DAPO itself scores
  that case wrong). Answer and ground truth are normalised with Minerva's rules and compared as
  strings. Score +1/-1, acc 1/0. Pure string work: runs in the calling process.
- `math_verify`: the whole completion goes through math-verify's own answer extraction (Hugging
  Face's Math-Verify: `\\boxed{}`, "the final answer is $X$", "The answer is: X", "Answer: X", else
  the last formula or number) and is compared with the parsed ground truth by `math_verify.verify`.
  For models that do not box their answers. Score and acc 1/0; always in the worker pool, under the
  reward's time limit.
"""

from __future__ import annotations

import re

from postrl.rewards.equivalence import completion_matches, math_equal, quick_equal
from postrl.rewards.verdict import VerifierResult, register
from postrl.rewards.text import last_boxed, minerva_normalize

__all__ = ["boxed_accuracy", "dapo_accuracy", "extract_dapo_answer", "last_boxed", "math_verify_accuracy"]


def _verdict(ok: bool) -> VerifierResult:
    return VerifierResult(float(ok), {"acc": float(ok)})


def _boxed_fast(completion: str, ground_truth: str, row: dict) -> VerifierResult | None:
    verdict = quick_equal(last_boxed(completion), ground_truth)
    return None if verdict is None else _verdict(verdict)


@register("math_17k_acc", "boxed_acc", "base_acc", fast=_boxed_fast, uses_row=False)
def boxed_accuracy(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """1.0 when the last \\boxed{} of the completion equals the ground truth (symbolically), else 0.0."""
    return _verdict(math_equal(last_boxed(completion), ground_truth))


@register("math_verify", uses_row=False)
def math_verify_accuracy(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """1.0 when the answer math-verify extracts from the completion equals the ground truth, else 0.0."""
    return _verdict(completion_matches(completion, ground_truth))


# ------------------------------------------------------------------------------------- DAPO
DAPO_TAIL_CHARS = 300  # DAPO scores only the end of the response (the longest MATH answer is ~160 chars)
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def extract_dapo_answer(completion: str) -> str | None:
    """The model's final answer under DAPO's rule: last `Answer:` line, else last \\boxed{} (tail only)."""
    tail = completion[-DAPO_TAIL_CHARS:]
    found = _ANSWER_LINE.findall(tail)
    if found:
        return found[-1]
    return last_boxed(tail)


@register("acc_for_dapo", "dapo", in_process=True, fail_score=-1.0, uses_row=False)
def dapo_accuracy(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """+1 when the normalised `Answer:` equals the normalised ground truth, else -1 (acc 1/0)."""
    answer = extract_dapo_answer(completion)
    ok = answer is not None and minerva_normalize(answer) == minerva_normalize(ground_truth[:10_000])
    return VerifierResult(1.0 if ok else -1.0, {"acc": float(ok)})


# ------------------------------------------------------------------- prompts vs the verifier's reading
BOXED_ONLY = frozenset({"math_17k_acc", "boxed_acc", "base_acc", "geo3k"})  # read nothing but \boxed{}
_ASKS_ANSWER_LINE = re.compile(r"Answer:\s*\$?Answer|after \"Answer:\"|form Answer:", re.IGNORECASE)


def answer_format_problem(prompt_texts: list[str], verifier_names: list[str]) -> str | None:
    """A warning when the prompts ask for an `Answer:` line but every verifier reads only \\boxed{}.

    DAPO-Math-17k's prompts end with "Answer: $Answer"; a model that obeys writes no box, and a
    boxed-only reader (math_17k_acc, as MindSpeed-RL's) scores every such completion 0, so nothing
    is learned until the model boxes by chance. Checked on the prompts' text before training.
    """
    if not prompt_texts or not set(verifier_names) <= BOXED_ONLY:
        return None
    asking = [p for p in prompt_texts if _ASKS_ANSWER_LINE.search(p) and "boxed" not in p]
    if len(asking) * 2 < len(prompt_texts):
        return None
    return (
        f"{len(asking)} of {len(prompt_texts)} training prompts ask for the answer on an 'Answer:' line (DAPO-Math-17k's "
        f"format), but reward.verifiers ({', '.join(verifier_names)}) read only the last \\boxed{{}}: a completion that "
        "obeys the prompt scores 0, as it does under MindSpeed-RL's math_17k_acc. Fix: use acc_for_dapo (reads the "
        "Answer: line) or math_verify, or preprocess with `postrl preprocess math_17k`, whose prompts also ask for "
        "\\boxed{}."
    )
