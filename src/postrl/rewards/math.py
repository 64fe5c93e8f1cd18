"""Math verifiers. Placeholder: exact match of the last \\boxed{} (the full set lands with issue 3)."""

from __future__ import annotations

from postrl.rewards.registry import VerifierResult, register


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text` (nested braces handled), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _norm(s: str) -> str:
    return s.strip().replace(" ", "").replace(",", "").rstrip(".")


@register("math_17k_acc")
@register("boxed_acc")
def boxed_accuracy(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """1.0 when the last \\boxed{} of the completion equals the ground truth, else 0.0."""
    pred = last_boxed(completion)
    ok = pred is not None and _norm(pred) == _norm(str(ground_truth))
    return VerifierResult(float(ok), {"acc": float(ok)})
