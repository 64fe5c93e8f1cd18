"""Evaluation: the trainer's validation (`evaluate`) and `postrl eval` of a model or checkpoint.

Both use `evaluate` below with the same engine, seed and `eval` settings, so a checkpoint evaluated
with `postrl eval` reports the accuracy the trainer logged for it.

Metrics, per validation set (named after the file's stem, or the built-in task's data source):
    val/<name>/acc_mean@n          mean accuracy over all n samples of all prompts (n = 1 when greedy)
    val/<name>/pass@k              k = 1, 2, 4, ..., n: chance that at least one of k samples is right,
                                   by the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)
    val/<name>/score_mean          mean weighted verifier score
    val/<name>/response_length_mean   the tokens the policy wrote (tool output not counted)
    val/<name>/tool_calls_mean, tool_call_ratio   with rollout.multi_turn: calls per trajectory, share that call
With `rollout.multi_turn.enable` the engine is the agent loop (docs/agents.md) and the verifiers read the
policy's own tokens. `eval.temperature: 0` is greedy decoding (one sample per prompt); with a temperature and
`eval.n_samples: n`, n samples per prompt are drawn from a fixed seed (train.seed).

    postrl eval CONFIG [overrides]            model.path of the config
    postrl eval CONFIG --model CKPT           a model directory, an iter_* checkpoint or a checkpoint root
    postrl eval CKPT [overrides]              a checkpoint with its own resolved config (config.yaml)
"""

from __future__ import annotations

from math import comb
from pathlib import Path

from postrl.errors import UserError


class ValidationHistory:
    """The headline validation metric over a run, and the line that compares its start, best and last.

    The metric is `checkpoint.keep_best` (a name or an fnmatch pattern such as val/*/acc_mean@1), else
    the first validation set's acc_mean@n.
    """

    def __init__(self, keep_best: str | None = None):
        self.keep_best = keep_best
        self.points: list[tuple[int, float]] = []  # (step, value)
        self.back_offs: list[tuple[int, int, float]] = []  # (step, the best's step, the value fallen to)

    def record(self, step: int, val: dict[str, float]) -> tuple[str, float] | None:
        """(metric name, value) of this validation, recorded; None when it reports no accuracy."""
        name = self._headline(val)
        if name is None and self.keep_best:
            raise UserError(
                f"checkpoint.keep_best is '{self.keep_best}', but validation reports only "
                f"{sorted(k for k in val if k.startswith('val/'))}. Fix: name one of those (the set is the "
                "validation file's stem), or a pattern such as val/*/acc_mean@1."
            )
        if name is None:
            return None
        self.points.append((step, val[name]))
        return name, val[name]

    def restore(self, step: int, best_step: int, best_value: float) -> None:
        """checkpoint.back_off put the best weights (of `best_step`) back at `step`: they are the weights
        from here, so they are this step's point, and the fall is remembered for the summary."""
        self.back_offs.append((step, best_step, self.points[-1][1]))
        self.points[-1] = (step, best_value)

    def replay(self, rows: list[dict], upto_step: int) -> None:
        """Record the validations an earlier part of the run logged (metrics.jsonl rows) up to a resumed
        step, so the start / best / last line covers the whole run; a step logged twice (a run resumed
        before) counts once, its last row."""
        by_step: dict[int, float] = {}
        for row in rows:
            name = self._headline(row)
            if name is not None and isinstance(row.get("step"), int) and row["step"] <= upto_step:
                by_step[row["step"]] = row[name]
        self.points = sorted(by_step.items()) + self.points

    def _headline(self, val: dict) -> str | None:
        import fnmatch

        return next((k for k in val if fnmatch.fnmatchcase(k, self.keep_best or "val/*/acc_mean@*")), None)

    def summary(self, best_dir: Path | None = None) -> str | None:
        """Start, best and last; a warning, with where the best weights are, when the run ended below its start."""
        if len(self.points) < 2:
            return None
        (s0, start), (s1, last) = self.points[0], self.points[-1]
        b, best = max(self.points, key=lambda sv: (sv[1], -sv[0]))
        line = f"held-out accuracy: start {start:.1%} (step {s0}), best {best:.1%} (step {b}), last {last:.1%} (step {s1})"
        if self.back_offs:
            line += "; back to the best weights (checkpoint.back_off / end_with_best): " + ", ".join(
                f"at step {s} from {fell:.1%} to step {to}'s weights" for s, to, fell in self.back_offs
            )
        if last >= start:
            kept = f"; the best weights (step {b}) are in {best_dir} (postrl export {best_dir} OUT)" if best_dir is not None else ""
            return f"[bold]{line}{kept}[/bold]"
        where = (
            f"the best weights are in {best_dir} (postrl export that directory)"
            if best_dir is not None
            else "set checkpoint.keep_best to keep the best weights"
        )
        return (
            f"[yellow]{line}: this run ended {start - last:.1%} below where it started; {where}. "
            "`postrl doctor CONFIG` says whether RL has headroom on this task and what to change.[/yellow]"
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    assert 0 < k <= n and 0 <= c <= n, f"pass_at_k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})"
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def report_ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def evaluate(engine, tokenizer, reward_fn, examples: list, eval_cfg, name: str, seed: int = 0, agent: bool = False, record=None) -> dict[str, float]:
    """acc_mean@n and pass@k of the engine's completions on `examples` (see the module docstring); `agent`:
    the engine is the agent loop (rollout.multi_turn.enable), which takes the prompts' rows. `record`
    (samples.SampleWriter.for_validation) receives (name, examples, completions, acc, scores) to write them."""
    from postrl.turns import generate_for, model_text, model_tokens
    from postrl.rollout import SamplingParams

    greedy = eval_cfg.temperature == 0
    n = 1 if greedy else eval_cfg.n_samples
    params = SamplingParams(temperature=eval_cfg.temperature or 1.0, max_tokens=eval_cfg.max_tokens, n=n, seed=seed, greedy=greedy)
    completions = generate_for(engine, examples, params, agent)  # the agent loop too, when rollout.multi_turn is on
    texts = [model_text(tokenizer, c) for c in completions]  # what the policy wrote, not the tools' output
    owners = [examples[c.prompt_index] for c in completions]
    res = reward_fn(texts, [e.ground_truth for e in owners], [e.row for e in owners])
    acc = res.metrics["acc"]
    correct = [0] * len(examples)
    for c, a in zip(completions, acc):
        correct[c.prompt_index] += a > 0
    out = {f"val/{name}/acc_mean@{n}": sum(acc) / len(acc)}
    for k in report_ks(n):
        out[f"val/{name}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
    scores = [s + c.env_reward for s, c in zip(res.scores, completions)]  # + environments', as in training
    out[f"val/{name}/score_mean"] = sum(scores) / len(scores)
    if record is not None:
        record(name, examples, completions, acc, scores)
    out[f"val/{name}/response_length_mean"] = sum(model_tokens(c) for c in completions) / len(completions)
    if any(c.turn_spans is not None for c in completions):  # the agent loop: how often the policy used its tools
        out[f"val/{name}/tool_calls_mean"] = sum(c.tool_calls for c in completions) / len(completions)
        out[f"val/{name}/tool_call_ratio"] = sum(c.tool_calls > 0 for c in completions) / len(completions)
    return out


def val_set_name(file: str, examples: list) -> str:
    return examples[0].data_source if file.startswith(("builtin:", "verifiers:")) else Path(file).stem


def load_val_sets(files: list[str], tokenizer, data_cfg, max_prompts: int, modality=None, tools=None, rows_of=None) -> dict[str, list]:
    """Validation sets by name (at most `max_prompts` prompts each): the trainer's, `postrl eval`'s, SFT's.

    `modality` is the policy's adapter (None: text), which encodes prompts with images; `tools` the agent
    loop's tool schemas (postrl.agents.loop.loop.tool_schemas); `rows_of` reads 'verifiers:' files (data.dataset.read_rows).
    """
    from postrl.data.dataset import load_prompts

    sets = {}
    for f in files:
        examples, _ = load_prompts([f], tokenizer, data_cfg, max_rows=max_prompts, modality=modality, tools=tools, rows_of=rows_of)
        if not examples:
            raise UserError(f"eval file '{f}' holds no usable prompts (all empty or overlong). Fix: check the file.")
        sets[val_set_name(f, examples)] = examples
    return sets
