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
- entropy:       entropy below a floor for several steps in a row: the policy has collapsed.
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


def entropy(value: float, floor: float, streak: int, need: int) -> str | None:
    if streak < need:
        return None
    return (
        f"guard entropy: actor/entropy has stayed below {floor} for {streak} steps (now {value:.4f}): the policy "
        "has collapsed onto near-deterministic outputs and explores nothing. Fix: lower train.lr, raise "
        "algorithm.clip_ratio_high (clip-higher), add algorithm.entropy_coef, or resume from an earlier checkpoint."
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
        self.warned: set[str] = set()  # each guard speaks once per run
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
        entropy_streak = self.streaks.update("entropy", m["actor/entropy"] < g.entropy_floor)
        signal_streak = self.streaks.update("no_signal", m[f"{name}/zero_spread_groups_ratio"] >= 1.0)
        found = {
            "first_ratio": first_ratio(gap, self.tolerance(g.first_ratio_tol), statistic),
            "drift": drift(m.get("rollout/logprob_diff_mean"), g.drift_limit),
            "entropy": entropy(m["actor/entropy"], g.entropy_floor, entropy_streak, g.entropy_steps),
            "no_signal": no_signal(signal_streak, g.no_signal_steps),
            "slow_reward": slow_reward(
                int(m.get("reward/timeouts", 0)), int(m.get("reward/calls", 0)), g.slow_reward_share, self.cfg.reward.timeout_s
            ),
        }
        for key, message in found.items():
            if message and key not in self.warned:
                self.warned.add(key)
                self.log(f"[yellow]warning (step {step}): {message}[/yellow]")

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
