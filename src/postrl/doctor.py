"""`postrl doctor CONFIG`: before a long run, does RL have headroom on this task with this model?

On a few dozen held-out prompts it measures, with the config's own engine, reward and sampling:
greedy accuracy (what evaluation reports), sampled accuracy at the rollout temperature (what RL
trains on) and pass@k (the chance that one of k samples is right: the ceiling RL can lift greedy
towards), at the configured temperature and a few lower ones. Then it says what the numbers mean:

- pass@k well above greedy (15+ points): RL has headroom; GRPO / DAPO turn the right samples into
  the greedy answer.
- sampled accuracy far below greedy: the policy samples badly at this temperature, so most groups
  are all wrong (no signal) and the update pushes on noise; a lower rollout.temperature gives RL
  samples close to what greedy decoding does.
- pass@k 8-15 points above greedy: some headroom; expect a few points.
- pass@k close to greedy: little to gain; RL can only sharpen (harder data, or more samples), and
  held-out greedy accuracy should stay near its start (issue 28: the recipes' KL to the SFT
  reference and checkpoint.back_off keep it there).
- pass@k near 0: nothing to learn from; an SFT warm start first.
"""

from __future__ import annotations

from typing import Any

TEMPERATURES = (0.6, 0.8, 1.0)
SOME_HEADROOM = 0.08  # pass@k this far above greedy: the tiny recipes lift greedy by 2+ points in 30 steps (docs/learning.md)


def diagnose(cfg: Any, n_prompts: int = 48, log=print) -> dict[str, Any]:
    """Greedy / sampled accuracy and pass@k on `n_prompts` held-out prompts (training prompts without val files)."""
    from postrl.assembly import build_run
    from postrl.agents.verifiers.env import dataset_rows
    from postrl.evaluate import evaluate, load_val_sets

    run = build_run(cfg, "doctor", log)
    policy, agent = run.policy, cfg.rollout.takes_rows
    files = (cfg.eval.files or cfg.data.train_files)[:1]
    name, examples = next(iter(load_val_sets(files, policy.tokenizer, cfg.data, n_prompts, policy.modality, run.tools, dataset_rows).items()))
    n = cfg.rollout.n_samples_per_prompt
    try:
        greedy_cfg = cfg.eval.model_copy(update={"temperature": 0.0, "n_samples": 1, "max_tokens": cfg.rollout.max_tokens})
        greedy = evaluate(run.engine, policy.tokenizer, run.reward_fn, examples, greedy_cfg, name, cfg.train.seed, agent)
        report = {"prompts": len(examples), "greedy": greedy[f"val/{name}/acc_mean@1"], "n": n, "sampled": {}}
        for t in sorted({*TEMPERATURES, cfg.rollout.temperature}):
            sample_cfg = cfg.eval.model_copy(update={"temperature": t, "n_samples": n, "max_tokens": cfg.rollout.max_tokens})
            m = evaluate(run.engine, policy.tokenizer, run.reward_fn, examples, sample_cfg, name, cfg.train.seed, agent)
            report["sampled"][t] = {"acc": m[f"val/{name}/acc_mean@{n}"], "pass@k": m[f"val/{name}/pass@{n}"]}
    finally:
        run.close()
    report["temperature"] = cfg.rollout.temperature
    report["advice"] = advice(report)
    return report


def advice(report: dict[str, Any]) -> list[str]:
    """What the numbers mean for RL on this task, and which settings to change."""
    greedy, n, t = report["greedy"], report["n"], report["temperature"]
    at_t = report["sampled"][t]
    best_t = max(report["sampled"], key=lambda x: (report["sampled"][x]["pass@k"] - greedy) + report["sampled"][x]["acc"])
    out = []
    if at_t["pass@k"] < 0.05:
        return [
            f"almost no sample is right (pass@{n} {at_t['pass@k']:.0%} at T {t}): RL has nothing to reinforce. "
            "Fix: an SFT warm start on reference solutions (postrl sft), or easier data."
        ]
    headroom = at_t["pass@k"] - greedy
    if headroom >= 0.15:
        out.append(
            f"RL has headroom: pass@{n} at T {t} is {at_t['pass@k']:.0%}, {headroom:.0%} above greedy ({greedy:.0%}); "
            "expect held-out greedy accuracy to rise towards it."
        )
    elif headroom >= SOME_HEADROOM:
        out.append(
            f"some headroom: pass@{n} at T {t} ({at_t['pass@k']:.0%}) is {headroom:.0%} above greedy ({greedy:.0%}); "
            "expect held-out greedy accuracy to rise a few points."
        )
    else:
        out.append(
            f"little headroom: pass@{n} at T {t} ({at_t['pass@k']:.0%}) is within {max(headroom, 0):.0%} of greedy "
            f"({greedy:.0%}); RL can only sharpen: expect held-out greedy accuracy to stay near its start. Consider "
            "harder data or more samples (rollout.n_samples_per_prompt)."
        )
    if at_t["acc"] < 0.5 * greedy:
        out.append(
            f"the policy samples much worse than it decodes greedily ({at_t['acc']:.0%} sampled at T {t} vs {greedy:.0%} "
            "greedy): most groups are all wrong, and the update learns from noise that greedy decoding never produces. "
            f"Fix: rollout.temperature: {best_t} (sampled {report['sampled'][best_t]['acc']:.0%}, "
            f"pass@{n} {report['sampled'][best_t]['pass@k']:.0%})."
        )
    return out


def print_report(report: dict[str, Any], console: Any) -> None:
    n = report["n"]
    console.print(f"{report['prompts']} held-out prompts; greedy accuracy {report['greedy']:.1%}")
    console.print(f"  {'temperature':>11}  {'sampled acc':>11}  {f'pass@{n}':>8}")
    for t, m in sorted(report["sampled"].items()):
        mark = "  <- rollout.temperature" if t == report["temperature"] else ""
        console.print(f"  {t:>11}  {m['acc']:>11.1%}  {m['pass@k']:>8.1%}{mark}", highlight=False)
    for line in report["advice"]:
        console.print(f"- {line}", highlight=False)
