"""Policy losses as plug-ins: each declares its hyperparameters with its registration (algorithms.LossSpec), the
config checks `algorithm.policy_loss_args` against them, and a user's 'module:function' loss trains with its own
hyperparameter (tests/losses_for_tests.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import run_postrl, tiny_overrides

from postrl import algorithms
from postrl.algorithms import (
    Param,
    aggregate_loss,
    declare_policy_loss,
    get_policy_loss_fn,
    loss_normalizers,
    policy_loss_spec,
    register_policy_loss,
    rollout_correction,
    rollout_loss_mask,
)
from postrl.checks import load_config
from postrl.config import build_config, dump_config
from postrl.errors import UserError
from postrl.metrics import read_jsonl
from postrl.trainer import train

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def problems_of(algorithm: dict, **sections) -> list[str]:
    with pytest.raises(UserError) as info:
        build_config({"model": {"path": "m"}, "algorithm": algorithm, **sections})
    return info.value.problems


# ------------------------------------------------------------------------------------------- registry


def test_builtin_losses_declare_their_preferred_defaults():
    assert policy_loss_spec(get_policy_loss_fn("gspo")).defaults == {
        "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"
    }  # fmt: skip
    assert policy_loss_spec(get_policy_loss_fn("cispo")).defaults == {"loss_agg_mode": "token-mean"}
    assert policy_loss_spec(get_policy_loss_fn("vanilla")).defaults == {}
    assert algorithms.DEFAULT_POLICY_LOSS in algorithms.POLICY_LOSSES


def test_no_policy_loss_name_appears_in_config_py():
    # The names live in algorithms/; the config package reads names, params and preferred defaults from the registry.
    text = "".join(f.read_text() for f in sorted((ROOT / "src" / "postrl" / "config").glob("*.py")))
    for name in algorithms.POLICY_LOSSES:
        assert not re.search(rf"\b{re.escape(name)}\b", text, re.IGNORECASE), name


def test_a_declaration_cannot_shadow_a_shared_setting_or_prefer_an_unknown_one():
    with pytest.raises(ValueError, match="clash with the shared settings"):
        declare_policy_loss(params={"clip_ratio_high": Param(0.2, "no")})
    with pytest.raises(ValueError, match="may prefer defaults for"):
        declare_policy_loss(defaults={"entropy_coef": 0.1})
    with pytest.raises(AssertionError, match="registered twice"):
        register_policy_loss("gspo")(lambda *a, **k: None)


def test_user_loss_resolves_by_module_function_and_plain_functions_declare_nothing():
    fn = get_policy_loss_fn("losses_for_tests:scaled")
    assert policy_loss_spec(fn).params["scale"] == Param(1.0, "Multiplies the vanilla clipped loss.", gt=0.0, le=10.0)
    assert policy_loss_spec(get_policy_loss_fn("losses_for_tests:undeclared")) == algorithms.LossSpec()


# --------------------------------------------------------------------------------------------- config


def test_policy_loss_args_are_resolved_with_the_declared_defaults():
    a = build_config({"model": {"path": "m"}, "algorithm": {"policy_loss": "losses_for_tests:scaled"}}).algorithm
    assert a.policy_loss_args == {"scale": 1.0}
    cfg = build_config(
        {"model": {"path": "m"}, "algorithm": {"policy_loss": "losses_for_tests:scaled", "policy_loss_args": {"scale": 3}}}
    )
    assert cfg.algorithm.policy_loss_args == {"scale": 3.0} and isinstance(cfg.algorithm.policy_loss_args["scale"], float)
    assert "policy_loss: losses_for_tests:scaled\n  policy_loss_args:\n    scale: 3.0\n" in dump_config(cfg)
    # a user loss without preferences gets the algorithm name's defaults
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.2, "seq-mean-token-mean")
    assert build_config({"model": {"path": "m"}}).algorithm.policy_loss_args == {}


def test_unknown_key_and_out_of_range_value_are_reported_with_the_rest():
    problems = problems_of(
        {"policy_loss": "losses_for_tests:scaled", "policy_loss_args": {"scale": 20.0, "scael": 1.0}, "clip_ratio_c": 0.5}
    )
    text = "\n".join(problems)
    assert len(problems) == 3, text
    assert (
        "algorithm.policy_loss_args: unknown key 'scael' for policy loss 'losses_for_tests:scaled'. Did you mean 'scale'? "
        "Valid keys: scale (0.0 < scale <= 10.0, default 1.0: Multiplies the vanilla clipped loss). "
        "Fix: use one of the keys it declares, or remove the key."
    ) in problems
    assert (
        "algorithm.policy_loss_args: scale = 20.0 is not valid for policy loss 'losses_for_tests:scaled': input should be "
        "less than or equal to 10. scale must be float with 0.0 < scale <= 10.0 (Multiplies the vanilla clipped loss). "
        "Fix: set algorithm.policy_loss_args.scale within that range, or leave it out for the default 1.0."
    ) in problems
    assert any(p.startswith("algorithm.clip_ratio_c") for p in problems)


def test_args_for_a_loss_that_declares_none_and_unloadable_losses():
    (problem,) = problems_of({"policy_loss_args": {"scale": 2.0}})
    assert "unknown key 'scale' for policy loss" in problem and "It declares no arguments." in problem
    (problem,) = problems_of({"policy_loss": "no_such_module:loss", "policy_loss_args": {"scale": 2.0}})
    assert problem.startswith("algorithm.policy_loss: policy loss 'no_such_module:loss' could not be loaded (ModuleNotFoundError")
    assert "add its directory to PYTHONPATH" in problem
    (problem,) = problems_of({"policy_loss": "losses_for_tests:NOT_A_FUNCTION"})
    assert "is a int, not a function" in problem
    (problem,) = problems_of({"policy_loss": "vanila"})
    assert "Did you mean 'vanilla'?" in problem and "or name your own function as 'package.module:function'" in problem


def test_check_config_shows_the_resolved_loss_arguments(tmp_path):
    cfg_file = tmp_path / "loss.yaml"
    cfg_file.write_text("model: {path: m}\nalgorithm: {policy_loss: 'losses_for_tests:scaled'}\n")
    proc = run_postrl("check-config", str(cfg_file), "--no-path-check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "policy_loss_args:\n    scale: 1.0\n" in proc.stdout


# ------------------------------------------------------------------------------------------- training


def first_step(tmp_path: Path, name: str, config_text: str) -> dict:
    (tmp_path / name).mkdir()
    yaml_file = tmp_path / name / "config.yaml"
    yaml_file.write_text(config_text)
    # token-mean: on-policy with seq-mean-token-mean the loss is -mean(A) = 0 and a scale would not show;
    # length_parity: a reward the random tiny model scores both ways, so advantages are not all 0
    overrides = ["train.total_steps=2", "algorithm.loss_agg_mode=token-mean", "reward.verifiers=[verifiers_for_tests:length_parity]"]
    cfg = load_config(yaml_file, tiny_overrides(tmp_path / name, *overrides))
    train(cfg)
    steps = [r for r in read_jsonl(tmp_path / name / "run" / "metrics.jsonl") if "timing/all" in r]
    assert len(steps) == 2
    return steps[0]


def test_a_user_loss_with_its_own_hyperparameter_trains_and_receives_it(tmp_path):
    scaled = first_step(
        tmp_path, "scaled", "algorithm:\n  policy_loss: losses_for_tests:scaled\n  policy_loss_args: {scale: 3.0}\n"
    )
    vanilla = first_step(tmp_path, "vanilla", "algorithm: {policy_loss: vanilla}\n")
    # The same seed gives the same first batch; the scale multiplies the loss and its gradient.
    assert abs(vanilla["actor/pg_loss"]) > 1e-4
    assert scaled["actor/pg_loss"] == pytest.approx(3.0 * vanilla["actor/pg_loss"], rel=1e-5)
    assert scaled["actor/grad_norm"] == pytest.approx(3.0 * vanilla["actor/grad_norm"], rel=1e-5)
    assert scaled["actor/entropy"] == vanilla["actor/entropy"]


# ---------------------------------------------------------------------------------- rollout correction


def test_only_the_truncating_level_keeps_every_token():
    assert [algorithms.rollout_correction_rejects(level) for level in algorithms.ROLLOUT_CORRECTIONS] == [
        False, True, True, True, True
    ]  # fmt: skip  (token, sequence, seq_mis, icepop, geo_rs)


def test_seq_mis_rejects_like_mis_and_weights_the_kept_sequences_by_their_ratio():
    # cap 2: keep iff |sum_t (p - q)| <= ln 2 = 0.693147 (the rows of the MIS test in test_algorithms/)
    # row 0: 0.6 -> rho e^0.6 = 1.822119 kept, weight rho; rows 1, 2: +-0.8 rejected; row 3: -0.3 -> 0.740818
    diff_BT = t([[0.3, 0.3], [0.5, 0.3], [-0.5, -0.3], [-0.3, 5.0]])
    mask_BT = t([[1, 1], [1, 1], [1, 1], [1, 0]])
    weight_BT, stats = rollout_correction(diff_BT, torch.zeros(4, 2, dtype=F64), mask_BT, level="seq_mis", cap=2.0)
    close(weight_BT, [[math.exp(0.6)] * 2, [0.0, 0.0], [0.0, 0.0], [math.exp(-0.3)] * 2])
    close(stats["rollout_corr/masked_frac"], 0.5)
    # mean over the 7 valid tokens: (2 x 1.822119 + 0.740818) / 7 = 0.626437
    close(stats["rollout_corr/weight_mean"], (2 * math.exp(0.6) + math.exp(-0.3)) / 7)
    close(stats["rollout_corr/weight_max"], math.exp(0.6))


def test_icepop_masks_tokens_outside_the_two_sided_range():
    # cap 2 (ln 2 = 0.693147): 0.3 kept, 0.8 out, -0.8 out, -0.5 kept, 0.69 kept, 5.0 masked anyway
    diff_BT = t([[0.3, 0.8], [-0.8, -0.5], [0.69, 5.0]])
    mask_BT = t([[1, 1], [1, 1], [1, 0]])
    weight_BT, stats = rollout_correction(diff_BT, torch.zeros(3, 2, dtype=F64), mask_BT, level="icepop", cap=2.0)
    close(weight_BT, [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    close(stats["rollout_corr/masked_token_frac"], 2 / 5)  # 2 of the 5 valid tokens
    close(stats["rollout_corr/weight_mean"], 3 / 5)


def test_geo_rs_bounds_the_geometric_mean_which_does_not_tighten_with_length():
    # cap 1.5 (ln 1.5 = 0.405465) on the mean log-ratio over valid tokens:
    # row 0: (0.3 + 0.4) / 2 = 0.35 kept (MIS would reject it: the sum 0.7 > 0.405); row 1: 0.45 out;
    # row 2: -0.45 out; row 3: 0.4 over its one valid token, kept (with the masked 9.0: 4.7, out)
    diff_BT = t([[0.3, 0.4], [0.3, 0.6], [-0.1, -0.8], [0.4, 9.0]])
    mask_BT = t([[1, 1], [1, 1], [1, 1], [1, 0]])
    weight_BT, stats = rollout_correction(diff_BT, torch.zeros(4, 2, dtype=F64), mask_BT, level="geo_rs", cap=1.5)
    close(weight_BT, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    close(stats["rollout_corr/masked_frac"], 0.5)
    mis_BT, _ = rollout_correction(diff_BT, torch.zeros(4, 2, dtype=F64), mask_BT, level="sequence", cap=1.5)
    close(mis_BT[0], [0.0, 0.0])


def test_rejected_tokens_leave_the_normalisers():
    # row 1 rejected (weight 0): 3 tokens in 2 sequences remain, not 5 in 3
    mask_BT = t([[1, 1], [1, 1], [1, 0]])
    loss_mask_BT = rollout_loss_mask(t([[1.8, 1.8], [0.0, 0.0], [0.7, 0.7]]), mask_BT)
    close(loss_mask_BT, [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    assert loss_normalizers(loss_mask_BT) == {"num_tokens": 3.0, "num_seqs": 2.0}
    # token-mean of per-token losses (2, 4 | 6, 8 | 3): (2 + 4 + 3) / 3 = 3, where the weight alone gave 9 / 5 = 1.8
    loss_BT = t([[2.0, 4.0], [6.0, 8.0], [3.0, 0.0]])
    close(aggregate_loss(loss_BT, loss_mask_BT, "token-mean", **loss_normalizers(loss_mask_BT)), 3.0)
    # seq-mean-token-mean: (3 + 3) / 2 = 3, not / 3
    close(aggregate_loss(loss_BT, loss_mask_BT, "seq-mean-token-mean", **loss_normalizers(loss_mask_BT)), 3.0)


@pytest.mark.parametrize("level", ["sequence", "icepop"])
def test_the_update_drops_rejected_sequences_from_the_token_mean(tmp_path, level):
    """One update where rollout correction rejects one sequence: its tokens leave the numerator and the denominator.

    With the old log-probs from their own pass the ratio is 1, so vanilla's token-mean loss is
    -sum_i A_i n_i / sum_i n_i over the kept sequences i (n_i their response tokens).
    """
    from postrl.trainer import Trainer

    overrides = [
        "reward.verifiers=[verifiers_for_tests:vowel_share]", "train.total_steps=1", "algorithm.loss_agg_mode=token-mean",
        "algorithm.rollout_correction.enable=true", f"algorithm.rollout_correction.level={level}",
    ]  # fmt: skip
    tr = Trainer(load_config(None, tiny_overrides(tmp_path, *overrides)))
    assert not tr.actor.on_policy  # a rejecting level needs the old log-probs before the update
    batch, _ = tr.experience.collect(tr.step, tr.timer)
    packed = tr.actor.pack(batch, tr.experience.advantages(batch))
    x = packed.tensors
    x["old_logp"] = tr.actor.compute_logprobs(tr.model, packed)
    x["engine_logp"] = x["old_logp"].clone()
    x["engine_logp"][0] -= 1.0  # p - q = 1 > ln 2 on every token of row 0: rejected at both levels
    stats = tr.actor.update(packed)
    tr.close()
    n_B, adv_B = x["response_mask"].float().sum(-1), x["adv"].double()
    kept = -(adv_B[1:] * n_B[1:]).sum() / n_B[1:].sum()
    weighted_only = -(adv_B[1:] * n_B[1:]).sum() / n_B.sum()  # what the weight alone gave: row 0 as zeros
    assert abs(kept - weighted_only) > 1e-3
    assert stats["actor/pg_loss"] == pytest.approx(float(kept), rel=1e-4, abs=1e-6)
    share = "rollout_corr/masked_frac" if level == "sequence" else "rollout_corr/masked_token_frac"
    # micro-batch stats are token-weighted means: row 0 is 1 of the 8 sequences of the first micro-batch
    expected_share = float(n_B[:8].sum() / 8 / n_B.sum()) if level == "sequence" else float(n_B[0] / n_B.sum())
    assert stats[share] == pytest.approx(expected_share, rel=1e-6)
