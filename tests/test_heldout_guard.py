"""The heldout_collapse guard and the length-aware entropy floor (src/postrl/guards.py), on hand-made histories:
no training. The collapse is issue 40's tool run (99% -> 49% held-out while the training reward rose); the
histories that must stay quiet are the recipes' measured ones (docs/learning.md, `make run`)."""

from __future__ import annotations

import json

import pytest
from conftest import quiet_console

from postrl import checkpoint, guards
from postrl.checks import load_config

METRIC = "val/lookup/acc_mean@1"


def _rewards(points: dict[int, float], last: int) -> dict[int, float]:
    """Per-step training reward, linear between the given (step: reward) points."""
    known = sorted(points.items())
    out = {}
    for step in range(1, last + 1):
        lo = max((p for p in known if p[0] <= step), default=known[0])
        hi = min((p for p in known if p[0] >= step), default=known[-1])
        out[step] = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (step - lo[0]) / (hi[0] - lo[0])
    return out


def _collapse(points, rewards, drop=0.1, share=0.25, window=5, tol=0.02):
    return guards.heldout_collapse(METRIC, points, rewards, drop, share, window, tol)


ISSUE_40 = [(0, 0.0), (10, 0.70), (20, 0.99), (30, 0.49)]  # held-out greedy accuracy of the tool run
ISSUE_40_REWARD = _rewards({1: 0.21, 10: 0.80, 20: 0.84, 30: 0.85}, 30)


def test_the_issue_40_tool_run_is_caught_at_its_collapse_and_not_before():
    for k in (2, 3):
        assert _collapse(ISSUE_40[:k], ISSUE_40_REWARD) is None  # rising: nothing to say
    message, best_step = _collapse(ISSUE_40, ISSUE_40_REWARD)
    assert best_step == 20
    assert "fell to 49.0% at step 30 from its best 99.0% at step 20 (50.0% below it)" in message
    assert "0.832 over the 5 steps to step 20, 0.848 over the last 5" in message
    assert "samples/val_step_30.jsonl against val_step_20.jsonl" in message
    # what issue 50's runs showed (docs/learning.md): the best weights end at the best; on the reproduction (3 of 3
    # seeds fell) the cosine schedule held within 2 points on every seed, at a lower best; the covariance loss did not
    assert "checkpoint.keep_best with end_with_best" in message and "train.lr_schedule: cosine" in message
    assert "ended 29-36 points below its best on 3 seeds of 3" in message
    assert "within 2 points of its best on all 3" in message
    assert "within 5 points of its best on 13 of 15 runs" in message
    assert "lower than the constant rate's on 12" in message
    assert "kl_cov and a KL ten times larger did not stop the falls" in message
    assert "going on brought most falls back, not all" in message and "21 runs to step 60" in message
    # the data fix the samples point to
    assert "entities have the held-out ones' form" in message
    # the second seed of the issue: 0% -> 69% -> 100% -> 70%
    assert _collapse([(0, 0.0), (10, 0.69), (20, 1.0), (30, 0.70)], ISSUE_40_REWARD) is not None


def test_a_fall_with_the_training_reward_falling_too_is_not_this_guards_pattern():
    fell = _rewards({1: 0.21, 20: 0.84, 26: 0.84, 30: 0.40}, 30)  # the last 5 steps: mean 0.58
    assert _collapse(ISSUE_40, fell) is None
    assert _collapse(ISSUE_40, {}) is None  # rewards unknown (e.g. before a resume): quiet


@pytest.mark.parametrize(
    "points, rewards, fires",
    [
        # docs/learning.md's measured histories with the training reward rising: small dips stay quiet
        ([(0, 0.423), (10, 0.380), (20, 0.390), (30, 0.403)], {1: 0.13, 30: 0.20}, False),  # sort, GRPO without KL
        ([(0, 0.903), (10, 0.917), (20, 0.933), (30, 0.903)], {1: 0.88, 30: 0.95}, False),  # increment, GRPO
        ([(0, 0.84), (10, 0.75), (20, 0.80), (30, 0.833)], {1: 0.14, 30: 0.30}, False),  # reverse, DAPO at T 1.0
        # from a low best, a quarter of it is well below: 20% -> 14%
        ([(0, 0.05), (10, 0.20), (20, 0.14)], {1: 0.1, 20: 0.3}, True),
        ([(0, 0.05), (10, 0.20), (20, 0.16)], {1: 0.1, 20: 0.3}, False),
    ],
)  # fmt: skip
def test_falls_well_below_the_best_are_caught_and_small_dips_are_not(points, rewards, fires):
    assert (_collapse(points, _rewards(rewards, points[-1][0])) is not None) == fires


def _guards(tmp_path, *extra):
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", f"logging.dir={tmp_path}",
                             "checkpoint.keep_best=val/*/acc_mean@1", *extra])  # fmt: skip
    console = quiet_console()
    return cfg, guards.Guards(cfg, console.print), console


def test_the_guard_warns_once_per_best_and_backs_off_only_where_back_off_is_on(tmp_path):
    for back_off, expect in ((None, None), ("0.6", 20)):  # back_off 0.6: a 50-point fall alone would not act
        cfg, g, console = _guards(tmp_path / str(back_off), *([f"checkpoint.back_off={back_off}"] if back_off else []))
        best = tmp_path / str(back_off) / "checkpoints" / checkpoint.BEST
        best.mkdir(parents=True)
        (best / "best.json").write_text(json.dumps({"step": 20, "metric": METRIC, "value": 0.99}))
        g.rewards = dict(ISSUE_40_REWARD)
        found = (METRIC, 0.49)
        hit = g.after_validation(ISSUE_40, found)
        assert hit and g.after_validation(ISSUE_40, found)  # holds again at the next look ...
        assert console.file.getvalue().count("guard heldout_collapse") == 1  # ... but speaks once
        kept = checkpoint.fell_below_best(cfg, found, last=False, collapsed=hit)
        assert (kept["step"] if kept else None) == expect
        assert checkpoint.fell_below_best(cfg, found, last=False, collapsed=False) is None  # back_off's own 0.6 not reached
    _, off, _ = _guards(tmp_path / "off", "guards.collapse_drop=0")
    off.rewards = dict(ISSUE_40_REWARD)
    assert off.after_validation(ISSUE_40, (METRIC, 0.49)) is False


def _step(entropy: float, length: float) -> dict[str, float]:
    return {"actor/entropy": entropy, "response_length/mean": length, "grpo/zero_spread_groups_ratio": 0.5, "grpo/rewards/mean": 0.8}


@pytest.mark.parametrize(
    "entropy, length, fires",
    [
        (0.012, 30.0, True),   # 0.36 nats per answer: above the per-token floor 0.01, below the answer's 0.5
        (0.30, 48.0, False),   # 14 nats per answer
        (0.005, 300.0, True),  # below the per-token floor whatever the length
        # issue 40's tool run (0.017 x 48 = 0.8 nats) and `make run` from step 14 on (0.73-0.99 nats, held-out
        # accuracy at its best 49.0%): the same entropy, one healthy, so entropy is not this failure's signal
        (0.017, 48.0, False),
        (0.0255, 28.5, False),
    ],
)  # fmt: skip
def test_the_entropy_floor_counts_the_whole_answer(tmp_path, entropy, length, fires):
    _, g, console = _guards(tmp_path)
    for step in range(1, 6):
        g.after_step(_step(entropy, length), step)
    assert ("guard entropy" in console.file.getvalue()) == fires
    if fires and entropy >= 0.01:
        assert f"{entropy * length:.2f} nats per {length:.0f}-token answer" in console.file.getvalue()


def test_the_closing_line_names_the_best_weights_and_how_to_export_them():
    from pathlib import Path

    from postrl.evaluate import ValidationHistory

    history = ValidationHistory("val/*/acc_mean@1")
    for step, value in ISSUE_40:
        history.record(step, {METRIC: value})
    history.restore(30, 20, 0.99)  # end_with_best put step 20's weights back at the end
    line = history.summary(Path("ck/best"))
    assert "best 99.0% (step 20), last 99.0% (step 30)" in line and "at step 30 from 49.0% to step 20's weights" in line
    assert "the best weights (step 20) are in ck/best (postrl export ck/best OUT)" in line


def test_the_rewards_before_a_resume_are_read_back_from_metrics_jsonl(tmp_path):
    _, g, _ = _guards(tmp_path)
    rows = [{"step": s, "grpo/rewards/mean": r} for s, r in ISSUE_40_REWARD.items()] + [{"step": 20, "val/lookup/acc_mean@1": 0.99}]
    g.replay(rows, upto_step=25)
    assert sorted(g.rewards) == list(range(1, 26)) and g.rewards[20] == pytest.approx(0.84)
    _, verl, _ = _guards(tmp_path / "verl", "logging.metric_names=verl")
    verl.replay([{"step": 3, "critic/rewards/mean": 0.5}], upto_step=25)  # verl's name of grpo/rewards/mean
    assert verl.rewards == {3: 0.5}


# `make run` (configs/tiny_dapo.yaml from the SFT model) measured in this session: held-out greedy accuracy at steps
# 0 / 10 / 20 / 30, and each step's dapo/rewards/mean, actor/entropy, response_length/mean (runs/tiny_dapo/metrics.jsonl).
MAKE_RUN_VAL = [(0, 0.1433), (10, 0.4733), (20, 0.49), (30, 0.48)]
MAKE_RUN_STEPS = [
    (1, 0.34, 0.177, 13.2), (2, 0.398, 0.1534, 15.7), (3, 0.32, 0.1747, 13.7), (4, 0.484, 0.1249, 17.2), (5, 0.527, 0.1037, 19.4),
    (6, 0.629, 0.0713, 22.6), (7, 0.625, 0.0748, 22.2), (8, 0.645, 0.0589, 23.0), (9, 0.641, 0.0552, 25.0), (10, 0.691, 0.0496, 26.3),
    (11, 0.719, 0.0444, 27.0), (12, 0.66, 0.0426, 26.2), (13, 0.672, 0.0379, 26.9), (14, 0.652, 0.0366, 27.2), (15, 0.613, 0.0363, 27.4),
    (16, 0.641, 0.0324, 28.1), (17, 0.57, 0.0447, 27.3), (18, 0.648, 0.0341, 28.6), (19, 0.633, 0.0314, 28.4), (20, 0.582, 0.0307, 27.9),
    (21, 0.719, 0.0282, 28.9), (22, 0.719, 0.0325, 27.4), (23, 0.625, 0.0315, 27.9), (24, 0.625, 0.0255, 28.5), (25, 0.711, 0.032, 28.8),
    (26, 0.551, 0.0276, 29.0), (27, 0.609, 0.029, 28.9), (28, 0.664, 0.0288, 28.1), (29, 0.656, 0.0314, 27.6), (30, 0.598, 0.0365, 29.3),
]  # fmt: skip


def test_the_make_run_recipe_trips_neither_guard(tmp_path):
    """The whole measured history, step by step and validation by validation, as the trainer feeds the guards."""
    cfg, g, console = _guards(tmp_path, "algorithm.name=dapo", "checkpoint.back_off=0.02")
    vals = dict(MAKE_RUN_VAL)
    points = [(0, vals[0])]
    assert g.after_validation(points, (METRIC, vals[0])) is False
    for step, reward, entropy, length in MAKE_RUN_STEPS:
        g.after_step({"actor/entropy": entropy, "response_length/mean": length, "dapo/rewards/mean": reward,
                      "dapo/zero_spread_groups_ratio": 0.5}, step)  # fmt: skip
        if step in vals:
            points.append((step, vals[step]))
            assert g.after_validation(points, (METRIC, vals[step])) is False
    assert "guard" not in console.file.getvalue()
    # the same history with the last validation fallen to the report's shape speaks (the guard is live here)
    assert g.after_validation(points[:-1] + [(30, 0.30)], (METRIC, 0.30)) is True
