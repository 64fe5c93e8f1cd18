"""Verifier registry and the weighted reward.

A verifier is a plain function `(completion: str, ground_truth: str, row: dict) -> VerifierResult`
(a bare float or bool, or a dict with a "score" key, is accepted too). Built-ins register
themselves by name with `@register("name")`; users name their own as `package.module:function` in
`reward.verifiers`, and a verl reward file (verl's compute_score signature) as `verl:path/to/file.py:name`
(rewards/verl_score.py).

`RewardFunction` scores a batch in two tiers, so the common case costs microseconds:
1. in the calling process, each verifier's cheap `fast` path (string and number comparison) or,
   for verifiers registered `in_process=True`, the verifier itself (pure, bounded string work). These
   read model-written text without a time limit, so they are linear and refuse absurd inputs
   (postrl/untrusted.py; counted in reward/unreadable), and a completion over MAX_IN_PROCESS_CHARS
   goes to tier 2 instead;
2. whatever is left (a symbolic check through math-verify, any user verifier) in a pool of worker
   processes, each call under a hard time limit (`reward.timeout_s`).

A call that overruns the limit, raises, or returns something that is not a finite number (NaN, a
string, None) scores the verifier's `fail_score` (0 unless registered otherwise). It is never silent:
each kind is counted per call of `RewardFunction` (`RewardOutput.failures`: reward/timeouts,
reward/errors, reward/invalid), warned about the first time it happens, and when (nearly) every call
of one weighted verifier fails the run stops with a `UserError`, since a reward that is always the
fail score teaches the policy nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

# The verdict types and the name registry live in a leaf module (the built-in verifiers and the
# worker pool import them without importing this one); re-exported here, where users look.
from postrl.rewards.verdict import (  # noqa: F401
    _REGISTRY,
    FastPath,
    InvalidVerdict,
    Verifier,
    VerifierEntry,
    VerifierResult,
    register,
    to_result,
)
from postrl.errors import FAIL_ALL_MIN_CALLS, FAIL_ALL_SHARE, fails_nearly_always  # noqa: F401 - the all-fail rule, re-exported
from postrl.untrusted import REWARD_UNREADABLE, pop_tripped
from postrl.utils import import_named

if TYPE_CHECKING:
    from postrl.rewards.pool import VerifierPool
    from postrl.rewards.reward_model import ModelScorer

log = logging.getLogger("postrl.rewards")


def registered_verifiers() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    # Importing the modules registers the built-in verifiers.
    import postrl.rewards.format  # noqa: F401
    import postrl.rewards.gsm8k  # noqa: F401
    import postrl.rewards.math  # noqa: F401
    import postrl.rewards.by_source  # noqa: F401  (after the verifiers it hands rows to)


def get_entry(name: str) -> VerifierEntry:
    """Resolve a registered name or a `package.module:function` path to its entry."""
    from postrl.errors import UserError

    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name.startswith("verl:"):  # verl's custom_reward_function file, called with verl's signature
        from postrl.rewards.verl_score import verl_verifier

        try:
            return VerifierEntry(verl_verifier(name))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    if ":" in name:
        try:
            fn = import_named(name, f"verifier '{name}'")
        except ValueError as exc:
            raise UserError(str(exc)) from None
        return VerifierEntry(fn)
    import difflib

    guess = difflib.get_close_matches(name, registered_verifiers(), n=1)
    hint = f" (did you mean '{guess[0]}'?)" if guess else ""
    raise UserError(
        f"unknown verifier '{name}'{hint}. Registered verifiers: {', '.join(registered_verifiers())}. "
        "Fix: use one of those, or name your own function as 'package.module:function'."
    )


def get_verifier(name: str) -> Verifier:
    """Resolve a registered name or a `package.module:function` path."""
    return get_entry(name).fn


def bound_entry(name: str, kwargs: dict | None = None) -> VerifierEntry:
    """The entry of `name`, its function called with `kwargs` as extra keyword arguments (verl's
    reward_kwargs); a function that does not take them by name is a UserError."""
    from postrl.errors import UserError

    entry = get_entry(name)
    if not kwargs:
        return entry
    from postrl.rewards.verl_score import VerlScore

    target = entry.fn.function() if isinstance(entry.fn, VerlScore) else entry.fn  # the user's file's function
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        params = {}
    takes_any = not params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    unknown = [k for k in kwargs if not takes_any and k not in named]
    if unknown:
        raise UserError(
            f"verifier '{name}' is given kwargs {', '.join(sorted(unknown))}, which its function "
            f"{getattr(target, '__name__', target)}{inspect.signature(target)} does not take. Fix: add them to the "
            "function's parameters (or **kwargs), or remove them from the verifier's kwargs."
        )
    return dataclasses.replace(entry, fn=functools.partial(entry.fn, **kwargs), fast=None)


def verifier_problems(specs: Sequence[str | tuple[str, dict]]) -> list[str]:
    """One message per verifier that does not resolve, or does not take its kwargs (config validation reports
    them with the rest); each item is a name or (name, kwargs)."""
    from postrl.errors import UserError

    problems = []
    for spec in specs:
        name, kwargs = (spec, None) if isinstance(spec, str) else spec
        try:
            bound_entry(name, kwargs)
        except UserError as exc:
            problems.extend(exc.problems)
    return list(dict.fromkeys(problems))


# The longest completion a verifier reads in the calling process (tens of milliseconds for the built-ins'
# linear readers); a longer one is scored in the worker pool, under reward.timeout_s.
MAX_IN_PROCESS_CHARS = 1 << 20

# Failure kinds: the status a verifier call ends with, and the metric that counts it.
FAILURE_METRICS = {"timeout": "reward/timeouts", "error": "reward/errors", "invalid": "reward/invalid"}
# FAIL_ALL_SHARE / FAIL_ALL_MIN_CALLS (postrl/errors.py): a verifier failing that share of its calls in one batch stops the run


@dataclass
class RewardOutput:
    """Scores of a batch of completions.

    `scores[i]` is the weighted sum over verifiers (plus the model rewards by weight);
    `metrics[name][i]` holds per-completion values: `acc` (from the first accuracy verifier that
    reports it; dynamic sampling filters on it) and, for each verifier, its own score under the verifier's name; with model rewards also rule_score,
    rm_score / judge_score (raw), their *_reward (as summed) and rm_rule_max / rm_rule_min (see
    `RewardFunction._add_model_rewards`). `timeouts`, `errors` and `invalid` count
    verifier calls that hit the time limit, raised, or returned no finite number (all score the
    verifier's fail_score); `timed_out[i]` says whether any call of completion i timed out; `unreadable`
    counts answers a reader's limit refused (an absurd number or length: scored wrong, not failed).
    """

    scores: list[float]
    metrics: dict[str, list[float]]
    timeouts: int = 0
    errors: int = 0
    timed_out: list[bool] = field(default_factory=list)
    invalid: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # model rewards' counts, e.g. reward/judge_unparsed
    unreadable: int = 0  # answers a reader refused in this process (postrl/untrusted.py), scored wrong

    @property
    def failures(self) -> dict[str, int]:
        """Failed calls of this batch by kind, under their metric names (logged per step)."""
        out = {"reward/timeouts": self.timeouts, "reward/errors": self.errors, "reward/invalid": self.invalid, **self.counts}
        return {**out, REWARD_UNREADABLE: self.unreadable} if self.unreadable else out  # the step starts it at 0

    def means(self) -> dict[str, float]:
        """Mean of every per-completion metric (the trainer logs them as <algo>/<name>/mean)."""
        return {k: (sum(v) / len(v) if v else 0.0) for k, v in self.metrics.items()}


class RewardSettings(Protocol):
    """What `RewardFunction` reads from the `reward` section (postrl.config.RewardConfig)."""

    verifiers: Sequence[Any]  # items with .name and .weight
    timeout_s: float
    workers: int


def _picklable(fn: Callable) -> bool:
    try:
        pickle.dumps(fn)
        return True
    except Exception:  # noqa: BLE001 - lambdas, closures, bound methods of odd objects
        return False


def _coerce_inputs(completions: list, ground_truths: list, rows: list) -> tuple[list[str], list[str], list[dict]]:
    """Strings and dicts, whatever the caller passed (None becomes "")."""
    n = len(completions)
    assert len(ground_truths) == n and len(rows) == n, (
        f"reward inputs differ in length: {n} completions, {len(ground_truths)} ground truths, {len(rows)} rows"
    )
    texts = [c if isinstance(c, str) else ("" if c is None else str(c)) for c in completions]
    truths = [g if isinstance(g, str) else ("" if g is None else str(g)) for g in ground_truths]
    return texts, truths, [r if isinstance(r, dict) else {} for r in rows]


class RewardFunction:
    """The weighted sum of the verifiers listed in `reward.verifiers`, plus any model rewards by weight.

    `models` are the scorers of `reward.reward_model` / `reward.judge` (`load_model_rewards`); with
    them, `score_rules` still gives the rules alone (validation stays rule-checked).

    Create once and reuse: the worker pool is started on the first call that needs it and lives
    until `close()`.
    """

    def __init__(self, cfg: RewardSettings, memory_limit_mb: int | None = 4096, models: Sequence["ModelScorer"] = ()):
        self.cfg = cfg
        self.models = list(models)  # reward model / judge (postrl.rewards.reward_model), added by weight
        self.verifiers: list[tuple[str, float, VerifierEntry]] = [
            (v.name, float(v.weight), bound_entry(v.name, getattr(v, "kwargs", None))) for v in cfg.verifiers
        ]
        self._memory_limit_mb = memory_limit_mb
        self._pool: "VerifierPool | None" = None
        self._in_process_only: set[str] = set()
        self._warned: set[tuple[str, str]] = set()  # (verifier, failure kind) already warned about
        for name, _, entry in self.verifiers:
            if not entry.in_process and not _picklable(entry.fn):
                self._in_process_only.add(name)
                log.warning(
                    "verifier '%s' cannot be sent to worker processes (not importable by name, e.g. a lambda "
                    "or a nested function); it runs in the trainer process without a time limit. Define it at "
                    "module level to get the time limit.",
                    name,
                )

    @property
    def pool(self) -> "VerifierPool":
        if self._pool is None:
            from postrl.rewards.pool import VerifierPool

            self._pool = VerifierPool(self.cfg.workers, self.cfg.timeout_s, self._memory_limit_mb, tuple(self.cfg.env_passthrough))
        return self._pool

    def _fail(self, counts: dict[str, list[str]], name: str, kind: str, message: str) -> None:
        """Record one failed call of verifier `name`; warn the first time each kind happens."""
        counts.setdefault(kind, []).append(message)
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            what = {"timeout": "timed out", "error": "raised", "invalid": "returned no valid score"}[kind]
            log.warning(
                "reward: verifier '%s' %s (%s); it scores its fail score, counted in %s from now on.",
                name, what, message, FAILURE_METRICS[kind],
            )  # fmt: skip

    def _check_not_all_failing(self, name: str, n_calls: int, counts: dict[str, list[str]]) -> None:
        """Stop the run when (nearly) every call of one verifier failed: its reward carries no signal."""
        n_failed = sum(len(m) for m in counts.values())
        if not fails_nearly_always(n_calls, n_failed):
            return
        from postrl.errors import UserError

        kind, messages = max(counts.items(), key=lambda kv: len(kv[1]))
        why = {
            "timeout": f"ran past reward.timeout_s ({self.cfg.timeout_s:g} s)",
            "error": "raised an exception",
            "invalid": "returned no finite number",
        }[kind]
        fix = {
            "timeout": f"raise reward.timeout_s (now {self.cfg.timeout_s:g}) if the verifier is slow but correct, "
            "or make it faster",
            "error": "fix the function (try it on one record with `postrl verify`)",
            "invalid": "make it return a finite number, a bool, a dict with a numeric 'score', or a VerifierResult",
        }[kind]
        raise UserError(
            f"verifier '{name}' failed on {n_failed} of its {n_calls} calls in this batch; {len(messages)} {why} "
            f"(counted in {FAILURE_METRICS[kind]}), for example: {messages[0]}. A failed call scores the fail "
            f"score, so the reward would carry no signal and training would learn nothing. Fix: {fix}.",
            title="the reward function fails on (nearly) every completion",
        )

    def __call__(self, completions: list[str], ground_truths: list[str], rows: list[dict]) -> RewardOutput:
        """Rule verdicts (tiered, time-limited), their weighted sum, then the model rewards by weight."""
        return self._score(completions, ground_truths, rows, self.models)

    def score_rules(self, completions: list[str], ground_truths: list[str], rows: list[dict]) -> RewardOutput:
        """The rule verifiers alone: validation's rule-checked accuracy, whatever model rewards train."""
        return self._score(completions, ground_truths, rows, [])

    def _score(self, completions: list, ground_truths: list, rows: list, models: list) -> RewardOutput:
        texts, truths, rows = _coerce_inputs(completions, ground_truths, rows)
        pop_tripped(REWARD_UNREADABLE)  # count this call's refusals only, not a direct call's before it
        results, failed, timed_out = self._verdicts(texts, truths, rows)
        for v, (name, weight, _) in enumerate(self.verifiers):
            if weight != 0:  # a weight-0 verifier is only logged: its failures are counted, not fatal
                self._check_not_all_failing(name, len(texts), failed[v])
        scores, metrics = self._combine(results)
        count = {kind: sum(len(f.get(kind, [])) for f in failed) for kind in FAILURE_METRICS}
        out = RewardOutput(scores, metrics, count["timeout"], count["error"], timed_out, count["invalid"])
        out.unreadable = pop_tripped(REWARD_UNREADABLE)
        if models:
            self._add_model_rewards(out, models, texts, truths, rows)
        return out

    def _verdicts(self, texts: list[str], truths: list[str], rows: list[dict]):
        """results[v][i] (verifier v on completion i), failed[v][kind] (messages), timed_out[i]."""
        from postrl.rewards.pool import Call

        n = len(texts)
        results: list[list[VerifierResult | None]] = [[None] * n for _ in self.verifiers]
        failed: list[dict[str, list[str]]] = [{} for _ in self.verifiers]
        timed_out = [False] * n
        queued: list[tuple[int, int]] = []
        calls: list[Call] = []
        for v, (name, _, entry) in enumerate(self.verifiers):
            for i in range(n):
                try:
                    quick = self._in_process(name, entry, texts[i], truths[i], rows[i])
                except Exception as exc:  # noqa: BLE001 - a verifier's bug scores fail_score, counted
                    kind = "invalid" if isinstance(exc, InvalidVerdict) else "error"
                    detail = str(exc) if kind == "invalid" else f"{type(exc).__name__}: {exc}"
                    self._fail(failed[v], name, kind, detail[:300])
                    results[v][i] = VerifierResult(entry.fail_score, {"acc": 0.0})
                    continue
                if quick is not None:
                    results[v][i] = quick
                    continue
                queued.append((v, i))
                calls.append(Call(entry.fn, texts[i], truths[i], rows[i] if entry.uses_row else {}))
        if calls:
            for (v, i), outcome in zip(queued, self.pool.run(calls)):
                name, _, entry = self.verifiers[v]
                if outcome.status == "ok" and outcome.result is not None:
                    results[v][i] = outcome.result
                    continue
                kind = outcome.status if outcome.status in FAILURE_METRICS else "error"
                timed_out[i] |= kind == "timeout"
                self._fail(failed[v], name, kind, outcome.message or "no result")
                results[v][i] = VerifierResult(entry.fail_score, {"acc": 0.0})
        return results, failed, timed_out

    def _in_process(self, name: str, entry: VerifierEntry, text: str, truth: str, row: dict) -> VerifierResult | None:
        """Tier 1: the verdict in this process (in-process verifier, or its fast path), None: ask the pool.

        The built-in readers are linear in the text, so a size cap is their time bound here: a completion
        longer than MAX_IN_PROCESS_CHARS goes to the pool, under its time limit, like a hard case."""
        if len(text) > MAX_IN_PROCESS_CHARS and name not in self._in_process_only:
            return None
        if entry.in_process or name in self._in_process_only:
            return to_result(entry.fn(text, truth, row))
        if entry.fast is not None:
            quick = entry.fast(text, truth, row)
            if quick is not None:
                return to_result(quick)
        return None

    def _combine(self, results: list[list[VerifierResult | None]]) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted sum per completion, each verifier's score, and `acc` (first accuracy verifier's)."""
        n = len(results[0]) if results else 0
        scores = [0.0] * n
        metrics: dict[str, list[float]] = {name: [0.0] * n for name, _, _ in self.verifiers}
        acc: list[float | None] = [None] * n
        fallback_acc: list[float | None] = [None] * n
        for v, (name, weight, entry) in enumerate(self.verifiers):
            for i in range(n):
                res = results[v][i]
                assert res is not None, "every verifier call has a verdict"
                scores[i] += weight * res.score
                metrics[name][i] = res.score
                if "acc" in res.metrics:
                    if entry.accuracy and acc[i] is None:
                        acc[i] = res.metrics["acc"]
                    if fallback_acc[i] is None:
                        fallback_acc[i] = res.metrics["acc"]
        metrics["acc"] = [
            a if a is not None else (f if f is not None else float(s > 0))
            for a, f, s in zip(acc, fallback_acc, scores)
        ]
        return scores, metrics

    def _add_model_rewards(self, out: RewardOutput, models: list, texts: list[str], truths: list[str], rows: list[dict]) -> None:
        """Add weight x (normalised) model score to each completion's rule sum; log the guides' metrics.

        Per completion: rule_score (the rules' weighted sum), <scorer.name> (raw score, e.g. rm_score),
        <scorer.name>_reward (what enters the sum: normalised when asked), and rm_rule_max / rm_rule_min
        (the larger / smaller of the model and the rule reward of that completion).
        """
        from postrl.rewards.reward_model import global_mean_std, normalized

        rule = list(out.scores)
        out.metrics["rule_score"] = rule
        model_total = [0.0] * len(texts)
        for scorer in models:
            result = scorer.score(texts, truths, rows)
            raw, failures, invalid = self._finite_scores(scorer, result)
            if invalid or scorer.name == "rm_score":
                out.counts[f"reward/{scorer.name.removesuffix('_score')}_invalid"] = invalid
            reward = normalized(raw, *global_mean_std(raw)) if scorer.normalize else list(raw)
            out.metrics[scorer.name] = raw
            out.metrics[f"{scorer.name}_reward"] = reward
            out.counts.update(result.counts)
            if scorer.weight != 0 and fails_nearly_always(len(raw), len(failures)):
                from postrl.errors import UserError

                what = {"rm_score": "the reward model", "judge_score": "the judge"}.get(scorer.name, scorer.name)
                raise UserError(
                    f"{what} gave no score for {len(failures)} of its {len(raw)} samples in this batch, for example: "
                    f"{failures[0]}. Each such sample scores the fail score ({getattr(scorer, 'fail_score', 0.0):g}), so "
                    f"its reward would carry no signal and training would learn nothing. Fix: {scorer.failure_fix}.",
                    title="a model reward fails on (nearly) every sample",
                )
            for i, r in enumerate(reward):
                model_total[i] += scorer.weight * r
        out.scores = [r + m for r, m in zip(rule, model_total)]
        model_reward = [sum(out.metrics[f"{s.name}_reward"][i] for s in models) for i in range(len(texts))]
        out.metrics["rm_rule_max"] = [max(m, r) for m, r in zip(model_reward, rule)]
        out.metrics["rm_rule_min"] = [min(m, r) for m, r in zip(model_reward, rule)]

    @staticmethod
    def _finite_scores(scorer: Any, result: Any) -> tuple[list[float], list[str], int]:
        """The scorer's scores with a non-finite one replaced by its fail score, every failed sample's line, and
        how many were non-finite (a NaN would poison the batch's normalisation and every advantage)."""
        fail = float(getattr(scorer, "fail_score", 0.0))
        raw = [s if math.isfinite(s) else fail for s in result.scores]
        bad = [f"score {s}" for s in result.scores if not math.isfinite(s)]
        return raw, list(result.failures) + bad, len(bad)

    def close(self) -> None:
        """Stop the worker processes and release the model rewards (safe to call twice)."""
        for scorer in self.models:
            scorer.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
