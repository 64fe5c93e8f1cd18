"""verl's default scoring: each row scored by the rule its `data_source` names (verl's default_compute_score).

verl's naive and DAPO reward managers call `default_compute_score(data_source, ...)`, so one run over
mixed data scores GSM8K rows by `####`, DAPO-Math-17k rows by DAPO's +1/-1 `Answer:` rule and geo3k
rows by the geo3k rule. `verl_default` does the same with postrl's verifiers, so a converted verl
recipe (`reward_model.reward_manager=dapo`) scores what verl would. A data_source outside the table is
an error, as in verl (name a verifier in reward.verifiers instead).
"""

from __future__ import annotations

import postrl.rewards.format  # noqa: F401  (the rules it hands rows to, registered in any process: the worker pool's too)
import postrl.rewards.gsm8k  # noqa: F401
import postrl.rewards.math  # noqa: F401
from postrl.rewards.verdict import _REGISTRY, VerifierResult, register

# verl's data_source names (verl/utils/reward_score/__init__.py), then the ones `postrl preprocess` writes.
SOURCES = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math_17k_acc",
    "DigitalLearningGmbH/MATH-lighteval": "math_17k_acc",
    "HuggingFaceH4/MATH-500": "math_17k_acc",
    "math_dapo": "acc_for_dapo",
    "hiyouga/geometry3k": "geo3k",
    "math": "math_17k_acc",
    "deepscaler": "math_17k_acc",
}


def verifier_for(data_source: str) -> str:
    """The postrl verifier verl's default_compute_score uses for rows of this data_source."""
    name = SOURCES.get(data_source) or ("acc_for_dapo" if data_source.startswith("aime") else None)
    if name is None:
        raise ValueError(
            f"verl_default has no rule for data_source '{data_source}' (verl raises NotImplementedError too); "
            f"known: {', '.join(SOURCES)}, aime*. Fix: name a verifier in reward.verifiers."
        )
    return name


def _fast(completion: str, ground_truth: str, row: dict) -> VerifierResult | None:
    try:
        entry = _REGISTRY[verifier_for(str(row.get("data_source", "")))]
    except ValueError:
        return None  # the worker pool's call raises it, counted and reported as a verifier error
    if entry.in_process:
        return entry.fn(completion, ground_truth, row)  # type: ignore[return-value]
    return entry.fast(completion, ground_truth, row) if entry.fast else None


@register("verl_default", fast=_fast)
def verl_default(completion: str, ground_truth: str, row: dict) -> VerifierResult:
    """The verdict of the verifier that row["data_source"] names, as verl's default_compute_score."""
    return _REGISTRY[verifier_for(str(row.get("data_source", "")))].fn(completion, ground_truth, row)  # type: ignore[return-value]
