"""Every shipped RL recipe keeps what RL found (issue 40): a recipe that validates keeps its best validation's weights
and ends with them (checkpoint.keep_best + end_with_best), and has the KL to the SFT model that fixed the text
recipes (docs/learning.md "Little headroom") or a note in the file saying why not ("KL off: ...")."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from postrl.checks import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
RL = [p for p in CONFIGS if not {"sft", "rm"} & set(yaml.safe_load(p.read_text()))]  # postrl sft / postrl rm configs train no policy by RL


def test_the_rl_recipes_are_the_ones_expected():
    names = {p.stem for p in RL}
    assert {"tiny_dapo", "tiny_grpo", "tiny_gspo", "tiny_rloo", "tiny_ppo", "tiny_tool_dapo", "tiny_vl_dapo", "tiny_vl_grpo",
            "qwen25_7b_grpo", "qwen25_32b_dapo", "qwen25_vl_7b_grpo"} <= names  # fmt: skip
    assert not names & {"tiny_sft", "tiny_tool_sft", "tiny_vl_sft", "tiny_rm"}


@pytest.mark.parametrize("path", RL, ids=lambda p: p.stem)
def test_a_recipe_that_validates_ends_with_its_best_weights(path):
    cfg = load_config(path, check_paths=False)
    validates = bool(cfg.eval.files or cfg.data.val_files) and (cfg.eval.before_train or cfg.eval.freq or cfg.eval.after_train)
    assert validates, f"{path.name} does not validate"
    assert cfg.checkpoint.keep_best is not None and cfg.checkpoint.keep_best.startswith("val/"), path.name
    assert cfg.checkpoint.end_with_best == 0.0, f"{path.name}: end_with_best {cfg.checkpoint.end_with_best}"
    assert cfg.guards.enable and cfg.guards.collapse_drop > 0  # the held-out collapse guard watches it


@pytest.mark.parametrize("path", RL, ids=lambda p: p.stem)
def test_a_recipe_has_the_kl_to_its_start_or_says_why_not(path):
    cfg = load_config(path, check_paths=False)
    has_kl = cfg.algorithm.kl.coef > 0 or cfg.algorithm.use_kl_in_reward
    assert has_kl or "KL off:" in path.read_text(), f"{path.name}: no KL and no 'KL off: <why>' note"
