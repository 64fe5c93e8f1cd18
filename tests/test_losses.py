"""Policy losses as plug-ins: each declares its hyperparameters with its registration (algorithms.LossSpec), the
config checks `algorithm.policy_loss_args` against them, and a user's 'module:function' loss trains with its own
hyperparameter (tests/losses_for_tests.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

from postrl import algorithms
from postrl.algorithms import Param, declare_policy_loss, get_policy_loss_fn, policy_loss_spec, register_policy_loss
from postrl.config import build_config, dump_config, load_config
from postrl.errors import UserError
from postrl.metrics import read_jsonl
from postrl.trainer import train

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    # The names live in algorithms.py; config.py reads names, params and preferred defaults from the registry.
    text = (ROOT / "src" / "postrl" / "config.py").read_text()
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
    proc = subprocess.run(
        [sys.executable, "-m", "postrl.cli", "check-config", str(cfg_file), "--no-path-check"], capture_output=True, text=True
    )
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
