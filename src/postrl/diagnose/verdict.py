"""The doctor's verdict on an engine-vs-trainer gap: rounding, stale weights, or a real difference, with the fix.

Read in this order, each test on numbers the report already holds (mismatch.py):
1. rounding: the gap is within the guards' tolerance for the dtype (float32: every token within 1e-3; bf16 / fp16:
   the mean within 5e-2; guards.sync_tol overrides), so it is rounding and kernel differences;
2. stale weights: on a probe sequence at temperature 1 (no sampling parameter plays) the engine's log-probs differ
   from the trainer's beyond the same tolerance: the engine holds other weights;
3. sampling parameters: the trainer's log-probs at another temperature match the engine's (the fit's gap at most a
   third of the gap at rollout.temperature): the engine sampled at that temperature; or the engine's log-probs are
   above the trainer's on 90% of the tokens with top-p / top-k on: they are renormalised over the kept set;
4. template: the first response position's gap is 4x the rest's: the engine conditioned on another prompt;
5. otherwise a real difference none of these explains.
"""

from __future__ import annotations

from typing import Any


def verdict(r: dict[str, Any]) -> dict[str, str]:
    gap, tol, fit = r["gap"], r["tolerance"], r["temperature_fit"]
    stat = tol["statistic"]
    value, limit, T = gap[stat], tol["value"], r["temperature"]
    said = f"|Δ log p| {stat} {value:.2e} over {gap['tokens']} tokens (tolerance {limit:.0e} in {tol['dtype']})"
    if value <= limit:
        return {
            "kind": "rounding",
            "summary": f"rounding: {said}: the engine and the trainer compute the same distribution up to {tol['dtype']} "
            "rounding and kernel differences.",
            "fix": "nothing to fix. In bf16 / fp16 a mean gap above 0.01 is worth algorithm.rollout_correction (level token, TIS, or "
            "icepop) so that the update weighs the engine's samples by the trainer's policy.",
        }
    probe = r.get("probe")
    if probe is not None and probe[stat] > limit:
        return {
            "kind": "stale_weights",
            "summary": f"stale weights: {said}, and on a probe sequence at temperature 1 the engine differs from the trainer "
            f"by {probe[stat]:.2e} ({stat} over {probe['tokens']} tokens), where no sampling parameter plays: the engine "
            "holds other weights than the trainer.",
            "fix": "make the engine hold the trainer's weights: the weight sync must reach it (rollout.engine: hf shares the "
            "trainer's model and cannot go stale), the engine must start from model.path, and with an asynchronous placement "
            "a batch rollout.max_staleness versions old differs by design (algorithm.rollout_correction weighs it).",
        }
    if abs(fit["best"] - T) > 0.04 * T and fit["gap_at_best"] <= fit["gap_at_configured"] / 3:
        return {
            "kind": "sampling_temperature",
            "summary": f"a real difference in the sampling parameters: {said}; the trainer's log-probs at temperature "
            f"{fit['best']:g} match the engine's ({fit['gap_at_best']:.2e} mean gap) far better than at rollout.temperature "
            f"{T:g}: the engine sampled at temperature about {fit['best']:g}.",
            "fix": f"give the engine rollout.temperature ({T:g}): an agent program or endpoint client that sets its own "
            "temperature, or an engine's generation config, overrides it; the trainer always scores at rollout.temperature.",
        }
    s = r["sampling"]
    if r["engine_more_confident"] >= 0.9 and (s["top_p"] < 1.0 or s["top_k"] > 0):
        return {
            "kind": "sampling_truncation",
            "summary": f"a real difference in the sampling parameters: {said}; the engine's log-prob is above the trainer's on "
            f"{r['engine_more_confident']:.0%} of the tokens: it is renormalised over the top-p / top-k set (rollout.top_p "
            f"{s['top_p']}, rollout.top_k {s['top_k']}) while the trainer scores the whole vocabulary.",
            "fix": "rollout.top_p: 1.0 and rollout.top_k: -1 for RL rollouts, or keep them and turn on "
            "algorithm.rollout_correction.",
        }
    pos = r["by_position"]
    if len(pos) > 1 and pos[0]["mean"] > 4 * max(sum(b["mean"] * b["tokens"] for b in pos[1:]) / max(sum(b["tokens"] for b in pos[1:]), 1), 1e-12):
        return {
            "kind": "template",
            "summary": f"a real difference in the prompt: {said}, most of it at the first response token ({pos[0]['mean']:.2e} "
            "there): the engine conditioned on another prompt than the trainer scores.",
            "fix": "render the prompt once and give the engine its token ids (the chat template, system prompt and BOS of "
            "data.* and of any agent program must agree); compare the two tokenizers (model.path and the engine's).",
        }
    return {
        "kind": "difference",
        "summary": f"a real difference: {said}; neither rounding, the weights (the probe agrees) nor the temperature "
        "explains it.",
        "fix": "compare what the engine and the trainer see: the chat template and tokenizer (model.path and the engine's), "
        "the sampling parameters (top-p, top-k, repetition penalty, logit processors), and the engine's dtype and "
        "quantisation; algorithm.rollout_correction weighs what remains.",
    }
