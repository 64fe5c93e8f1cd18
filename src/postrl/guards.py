"""Correctness guards, on by default: the silent failures users report in the peers, caught and named.

Each check reads numbers the loop already has and returns what it found as one message (what, why,
what to do), or None. The trainer prints a warning, or stops with a UserError where going on would
waste the run (weights that never reach the rollout engine). docs/algorithms.md lists them.

- first_ratio:   before the first optimizer step the policy IS the old policy, so the importance
                 ratio must be 1 (every token in float32, on average in bf16 / fp16): a gap means
                 the old-log-prob pass and the update pass compute different things (dropout, a
                 different attention path, padding).
- sync:          after each weight sync, the engine's log-probs of a fixed probe sequence must equal
                 the trainer's (every token in float32, on average in bf16 / fp16): a gap means the
                 sync did not happen (trl#5312, verl#7495).
- drift:         the engine's sampling log-probs vs the trainer's on the batch (rollout/logprob_diff_mean).
- entropy:       entropy below a floor for several steps in a row: the policy has collapsed. Two floors: per
                 token (entropy_floor), and per answer (entropy x mean response length below
                 seq_entropy_floor nats, 0.5: e^0.5 = 1.6 distinct answers in a group, however high the
                 per-token number looks on a long answer). Issue 40's 0.017 on a 48-token answer (0.8 nats)
                 stays above it on purpose: the healthy `make run` ends at 0.7-0.9 nats per answer.
- heldout_collapse: at a validation, held-out accuracy well below its best while the training reward
                 holds or rises: the policy fits the training prompts and loses what carried over (on agent
                 tasks, copying an unseen entity into the tool call: docs/learning.md). Backs off to the best
                 weights where checkpoint.back_off is on.
- no_signal:     every group's reward without spread for several steps in a row: zero advantages,
                 nothing to learn.
- slow_reward:   more than a share of the reward calls of a step hit reward.timeout_s.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from postrl.errors import UserError


@dataclass
class Streaks:
    """Consecutive steps for which a condition held (per named condition)."""

    counts: dict[str, int] = field(default_factory=dict)

    def update(self, name: str, holds: bool) -> int:
        self.counts[name] = self.counts.get(name, 0) + 1 if holds else 0
        return self.counts[name]


def first_ratio(gap: float, tol: float, statistic: str = "largest") -> str | None:
    if gap <= tol:
        return None
    return (
        f"guard first_ratio: before the first optimizer step the policy ratio should be exactly 1, but "
        f"|logp - logp_old| is {gap:.2e} ({statistic} over the tokens; tolerance {tol:.0e}). The old-log-prob pass and the "
        "update pass compute different log-probs (dropout left on, a different attention path or padding), so "
        "every ratio and clip decision is off. Fix: set the model's dropout to 0 (config.json attention_dropout / "
        "hidden_dropout) or report the model family."
    )


def sync(gap: float, tol: float, engine: str, statistic: str = "largest") -> str | None:
    if gap <= tol:
        return None
    return (
        f"guard sync: after the weight sync the {engine} engine's log-probs of a probe sequence differ from the "
        f"trainer's by {gap:.2e} ({statistic} gap over its tokens; tolerance {tol:.0e}): the engine did not receive the updated "
        "weights, so every rollout from now on samples from a stale policy and the run would train on nothing. "
        "Fix: check the engine's weight loading (rollout.engine: hf avoids it), or raise guards.sync_tol if the "
        "engine runs in lower precision than the trainer."
    )


def drift(diff_mean: float | None, limit: float) -> str | None:
    if diff_mean is None or diff_mean <= limit:
        return None
    return (
        f"guard drift: the engine's sampling log-probs differ from the trainer's by {diff_mean:.3f} per token on "
        f"average (limit {limit}). The samples come from a policy noticeably different from the one being trained. "
        "Fix: turn on algorithm.rollout_correction (TIS) to reweight them, or use the same dtype in both."
    )


def entropy(value: float, floor: float, streak: int, need: int, length: float | None = None, seq_floor: float | None = None) -> str | None:
    """Per-token entropy below `floor`, or (with `length`, the mean response length) the answer's entropy
    value x length below `seq_floor` nats, for `need` steps in a row (`streak`)."""
    if streak < need:
        return None
    if value < floor or not (length and seq_floor):
        what = f"actor/entropy has stayed below {floor} for {streak} steps (now {value:.4f})"
    else:
        what = (f"the answers' entropy (actor/entropy x response_length/mean) has stayed below {seq_floor} nats for {streak} "
                f"steps (now {value:.4f} per token, {value * length:.2f} nats per {length:.0f}-token answer)")  # fmt: skip
    return (
        f"guard entropy: {what}: the policy has collapsed onto near-deterministic outputs, the samples of "
        "a group are nearly all the same, and it explores nothing. Fix: lower train.lr, raise "
        "algorithm.clip_ratio_high (clip-higher), add algorithm.entropy_coef or algorithm.kl.coef (KL to the SFT "
        "model), or resume from an earlier checkpoint (checkpoint.keep_best)."
    )


def collapsed(value: float, best: float, drop: float, share: float) -> bool:
    """Held-out accuracy `value` well below its `best`: by more than `drop` (absolute) or `share` of the best,
    whichever is smaller (from 99% a fall of 10 points, from 20% one of 5)."""
    return best - value > min(drop, share * best) + 1e-9


def heldout_collapse(
    metric: str, points: list[tuple[int, float]], rewards: dict[int, float], drop: float, share: float, window: int, tol: float
) -> tuple[str, int] | None:
    """(message, the best's step) when the last validation in `points` ((step, value), oldest first) fell well
    below the best one (`collapsed`) while the training reward (`rewards`: step -> mean reward) held or rose:
    the mean over the `window` steps before the last validation is at least the mean over the `window` steps
    up to the best one (from step 1 when the best is the start) less `tol`. None otherwise, or without the rewards."""
    if len(points) < 2:
        return None
    (step, value), (b, best) = points[-1], max(points, key=lambda sv: (sv[1], -sv[0]))
    if b >= step or not collapsed(value, best, drop, share):
        return None

    def mean_over(first: int, last: int) -> float | None:
        got = [rewards[s] for s in range(first, last + 1) if s in rewards]
        return sum(got) / len(got) if got else None

    at_best = mean_over(max(b - window + 1, 1), b) if b > 0 else mean_over(1, window)  # the start: the first steps'
    now = mean_over(step - window + 1, step)
    if at_best is None or now is None or now < at_best - tol:
        return None  # the training reward fell too: not this guard's pattern (or unknown, e.g. before a resume)
    return (
        f"guard heldout_collapse: {metric} fell to {value:.1%} at step {step} from its best {best:.1%} at step {b} "
        f"({best - value:.1%} below it), while the training reward held ({at_best:.3f} over the {window} steps to step "
        f"{max(b, 1)}, {now:.3f} over the last {window}): the policy fits the training prompts and loses what carried over "
        "to unseen ones (on agent tasks, e.g. copying an unseen name into the tool call). Read the failing "
        f"trajectories in <logging.dir>/samples/val_step_{step}.jsonl against val_step_{b}.jsonl. Fix: keep the best "
        "weights (checkpoint.keep_best with end_with_best, or back_off to go back now): the one setting that ended at "
        "the best on every measured seed. To hold the accuracy itself, decay the learning rate (train.lr_schedule: "
        "cosine): on issue 50's reproduction (ten training names, no KL), where the constant rate ended 29-36 points "
        "below its best on 3 seeds of 3, it ended within 2 points of its best on all 3, 39-68 points above the start; "
        "over every variant measured it ended within 5 points of its best on 13 of 15 runs, at a best lower than the "
        "constant rate's on 12 of them. kl_cov and a KL ten times larger did not stop the falls. If steps are left, "
        "going on brought most falls back, not all (12 of the shipped recipe's 21 runs to step 60 ended at their "
        "best). What the samples point to is data: training prompts whose entities have the held-out ones' form "
        "(docs/learning.md).",
        b,
    )


def no_signal(streak: int, need: int) -> str | None:
    if streak < need:
        return None
    return (
        f"guard no_signal: for {streak} steps every group's rewards were all equal, so every advantage was 0 and "
        "the update learned nothing. The data is too easy or too hard for this model. Fix: turn on dynamic "
        "sampling (algorithm.filter_groups.enable), raise rollout.n_samples_per_prompt, or use data matched to "
        "the model (an SFT warm start)."
    )


def slow_reward(timeouts: int, calls: int, share: float, timeout_s: float) -> str | None:
    if calls == 0 or timeouts / calls <= share:
        return None
    return (
        f"guard slow_reward: {timeouts} of {calls} reward calls this step hit reward.timeout_s ({timeout_s} s) and "
        "scored 0, so rewards are wrong for those completions and each step waits on the time limit. Fix: raise "
        "reward.timeout_s, or make the verifier faster."
    )


class Guards:
    """The guards of one run: streak state, what has been said, and the two checks the loop calls."""

    def __init__(self, cfg: Any, log=print):
        self.cfg, self.log = cfg, log
        self.g = cfg.guards
        self.streaks = Streaks()
        self.warned: set[str] = set()  # each guard speaks once per run (heldout_collapse once per best)
        self.rewards: dict[int, float] = {}  # step -> the training batch's mean reward (heldout_collapse)
        # Two computations of the same log-probs agree on every token in float32; in bf16 / fp16 another
        # kernel (another engine, or another attention backend with and without grad) rounds logits of
        # size ~10 in their 8th significant bit, and a few unlikely tokens differ by 0.1 or more with the
        # same weights (verl logs such maxima as rollout_probs_diff_max): there the mean gap is the test.
        self.exact = cfg.model.dtype == "float32"

    def tolerance(self, configured: float | None) -> float:
        """The log-prob gap allowed between two computations of the same thing: the largest over the
        tokens within 1e-3 in float32, the mean within 5e-2 in bf16 / fp16 (unless configured)."""
        return configured or (1e-3 if self.exact else 5e-2)

    def _first_ratio_gap(self, m: dict[str, float]) -> tuple[float, str]:
        if self.exact:
            return m.get("actor/first_ratio_gap", 0.0), "largest"
        return m.get("actor/first_ratio_gap_mean", 0.0), "mean"

    def after_step(self, m: dict[str, float], step: int) -> None:
        """Warn once per guard on what the step's metrics show."""
        g, name = self.g, self.cfg.algorithm.name
        if not g.enable:
            return
        gap, statistic = self._first_ratio_gap(m)
        length = m.get("response_length/mean")
        low = m["actor/entropy"] < g.entropy_floor or bool(length and m["actor/entropy"] * length < g.seq_entropy_floor)
        entropy_streak = self.streaks.update("entropy", low)
        if f"{name}/rewards/mean" in m:
            self.rewards[step] = m[f"{name}/rewards/mean"]
        signal_streak = self.streaks.update("no_signal", m[f"{name}/zero_spread_groups_ratio"] >= 1.0)
        found = {
            "first_ratio": first_ratio(gap, self.tolerance(g.first_ratio_tol), statistic),
            "drift": drift(m.get("rollout/logprob_diff_mean"), g.drift_limit),
            "entropy": entropy(m["actor/entropy"], g.entropy_floor, entropy_streak, g.entropy_steps, length, g.seq_entropy_floor),
            "no_signal": no_signal(signal_streak, g.no_signal_steps),
            "slow_reward": slow_reward(
                int(m.get("reward/timeouts", 0)), int(m.get("reward/calls", 0)), g.slow_reward_share, self.cfg.reward.timeout_s
            ),
        }
        for key, message in found.items():
            if message and key not in self.warned:
                self.warned.add(key)
                self.log(f"[yellow]warning (step {step}): {message}[/yellow]")

    def replay(self, rows: list[dict], upto_step: int) -> None:
        """The training rewards an earlier part of the run logged (metrics.jsonl rows, any logging.metric_names),
        so heldout_collapse compares across a resume."""
        from postrl.metrics import lookup

        name = self.cfg.algorithm.name
        for row in rows:
            value = lookup(row, f"{name}/rewards/mean", name)
            if value is not None and isinstance(row.get("step"), int) and row["step"] <= upto_step:
                self.rewards[row["step"]] = value

    def after_validation(self, points: list[tuple[int, float]], found: tuple[str, float] | None) -> bool:
        """heldout_collapse on the headline validation history (`points`, ValidationHistory's); True when it holds
        (the trainer then backs off where checkpoint.back_off is on). Speaks once per best."""
        g = self.g
        if not g.enable or found is None or not g.collapse_drop:
            return False
        hit = heldout_collapse(found[0], points, self.rewards, g.collapse_drop, g.collapse_share, g.collapse_window, g.collapse_reward_tol)
        if hit is None:
            return False
        message, best_step = hit
        if f"heldout_collapse@{best_step}" not in self.warned:
            self.warned.add(f"heldout_collapse@{best_step}")
            self.log(f"[yellow]warning (step {points[-1][0]}): {message}[/yellow]")
        return True

    @torch.no_grad()
    def check_sync(self, engine: Any, model: torch.nn.Module, probe: list[int], autocast: Any = None) -> dict[str, float]:
        """The engine scores a probe sequence as the trainer's model does, or the run stops. MoE models:
        returns moe/routing_mismatch, the share of (layer, token) pairs of the probe whose top-k experts
        differ between the engine's routers and the trainer's (postrl.moe)."""
        from postrl.models import response_logprobs
        from postrl.moe import RouterTrace, is_moe, routing_mismatch

        if not self.g.enable:
            return {}
        engine_lp = engine.probe_logprobs(probe)
        if engine_lp is None:  # the engine generates with the trainer's own model
            return {}
        device = next(model.parameters()).device
        ids = torch.tensor([probe], device=device)
        positions = torch.arange(len(probe), device=device)[None]
        trace = RouterTrace(model) if is_moe(model) else None
        with autocast or contextlib.nullcontext(), trace or contextlib.nullcontext():  # the model's compute dtype
            mine, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, len(probe) - 1)
        diff = (mine[0].cpu() - torch.tensor(engine_lp)).abs()
        gap, statistic = (float(diff.max()), "largest") if self.exact else (float(diff.mean()), "mean")
        if (message := sync(gap, self.tolerance(self.g.sync_tol), engine.name, statistic)) is not None:
            raise UserError(message)
        if trace is None:
            return {}
        engine_LNK = engine.probe_routing(probe, int(trace.routers[0].top_k))
        if engine_LNK is None:
            return {}
        return {"moe/routing_mismatch": routing_mismatch(engine_LNK, trace.stacked()[1].cpu())}


def note_uncorrectable(cfg, engine, log) -> None:
    """Say at start when algorithm.rollout_correction is on but the engine reports no sampling log-probs."""
    if cfg.algorithm.rollout_correction.enable and not engine.capabilities.reports_logprobs:
        log(
            f"[yellow]algorithm.rollout_correction is on, but the {engine.name} engine reports no sampling log-probs "
            "(it samples with the trainer's own model, so there is no gap to correct): no correction is applied.[/yellow]"
        )
