"""A verl script is data (issue 64): nothing in it runs, a value reaches only the keys the mapping made, settings
that run code wait for --allow-code, verl's tool config is carried, and sapo / geo_mean train verl's loss."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import yaml

from postrl.algorithms import aggregate_loss, get_policy_loss_fn
from postrl.cli import _from_script, main
from postrl.config import build_config
from postrl.errors import UserError
from postrl.guides import code_keys, convert_file, render_yaml

RETOOL = Path(__file__).resolve().parent / "guides_inputs" / "verl" / "retool" / "run_retool.sh"
TINY = "actor_rollout_ref.model.path=builtin:tiny-qwen2 data.train_files=builtin:arithmetic:train"


def _out(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())


def _hostile(tmp_path: Path) -> Path:
    """A quoted multi-line variable that, copied raw into a YAML comment, would set rollout.agent and trust_remote_code."""
    src = tmp_path / "run.sh"
    src.write_text('NOTE="x\nrollout:\n  agent: evil_pkg.agent:run\nmodel:\n  trust_remote_code: true\n# "\n'
                   f"python3 -m verl.trainer.main_ppo {TINY} trainer.project_name=\"$NOTE\" trainer.total_training_steps=1\n")  # fmt: skip
    return src


def test_the_rendered_yaml_reads_back_as_the_tree(tmp_path):
    conv = convert_file(_hostile(tmp_path))
    text = render_yaml(conv, "run.sh")
    assert yaml.safe_load(text) == conv.tree  # every note and comment escaped: no value reaches another key
    cfg = build_config(yaml.safe_load(text))
    assert (cfg.rollout.agent, cfg.model.trust_remote_code) == (None, False)
    assert "trainer.project_name = 'x\\nrollout:\\n  agent: evil_pkg.agent:run\\nmodel:" in text  # the value, escaped in its comment


def test_train_script_builds_the_run_from_the_validated_tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(config=str(_hostile(tmp_path)), env=[], overrides=[], allow_code=False)
    cfg, path = _from_script(args)
    conv = convert_file(args.config)
    assert cfg == build_config(conv.tree)
    assert yaml.safe_load(Path(path).read_text()) == conv.tree  # what launched ranks read is the same tree
    assert (cfg.rollout.agent, cfg.model.trust_remote_code) == (None, False)


def test_code_settings_are_listed_and_wait_for_allow_code(tmp_path, capsys, monkeypatch):
    """convert-config imports nothing (a reward file that would leave a marker leaves none); train asks first."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "imported"
    reward = tmp_path / "reward.py"
    reward.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    src = tmp_path / "run.sh"
    src.write_text(f"python3 -m verl.trainer.main_ppo {TINY} actor_rollout_ref.model.trust_remote_code=True "
                   f"custom_reward_function.path={reward} trainer.total_training_steps=1\n")  # fmt: skip
    assert main(["convert-config", str(src)]) == 0
    printed = _out(capsys)
    assert "# Settings that run code other than postrl's (2)" in printed
    assert "model.trust_remote_code = True: runs the Python files" in printed and f"reward.verifiers[0] = 'verl:{reward}:compute_score'" in printed
    assert not marker.exists()
    assert main(["train", str(src)]) == 2
    printed = _out(capsys)
    assert "sets 2 setting(s) that run code other than postrl's" in printed and "--allow-code" in printed
    assert not marker.exists() and not (tmp_path / "runs").exists()
    assert [k for k, _, _ in code_keys(convert_file(src).tree)] == ["model.trust_remote_code", "reward.verifiers[0]"]


def test_env_name_alone_takes_the_environment(tmp_path, capsys, monkeypatch):
    src = tmp_path / "run.sh"
    src.write_text(f"python3 -m verl.trainer.main_ppo {TINY} trainer.experiment_name=$RUN\n")
    monkeypatch.setenv("RUN", "from_env")
    out = tmp_path / "c.yaml"
    assert main(["convert-config", str(src), "-o", str(out)]) == 2  # not read unless named
    assert "--env RUN" in _out(capsys)
    assert main(["convert-config", str(src), "--env", "RUN", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["logging"]["dir"] == "runs/from_env"


# ------------------------------------------------------------------------------------------------ tools
def test_retool_style_script_carries_the_sandbox_fusion_tool(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not verl's directory: the file is found beside the script
    conv = convert_file(RETOOL)
    cfg = build_config(conv.tree)
    mt = cfg.rollout.multi_turn
    assert (mt.enable, mt.tools, mt.max_turns, mt.tool_timeout_s) == (True, ["builtin:python"], 8, 20.0)
    assert (mt.sandbox.backend, mt.sandbox.url, mt.sandbox.memory_mb, mt.sandbox.concurrency) == ("sandbox_fusion", "http://127.0.0.1:8080", 512, 6)
    instead = {u.source.rsplit(" ", 1)[-1]: u.instead for u in conv.unmapped}
    assert "verl's own Gsm8kTool: postrl has no counterpart" in instead["verl.tools.gsm8k_tool.Gsm8kTool"]
    assert "a verl BaseTool class" in instead["my_tools.search.SearchTool"] and "package.module:function" in instead["my_tools.search.SearchTool"]
    assert code_keys(conv.tree) == []  # builtin:python runs model-written code in the sandbox, not the user's


def test_a_missing_tool_config_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "run.sh"
    src.write_text(RETOOL.read_text().replace("tool_config_path=sandbox_fusion_tool_config.yaml", "tool_config_path=conf/tools.yaml"))
    with pytest.raises(UserError) as exc:
        convert_file(src)
    assert f"line 17: actor_rollout_ref.rollout.multi_turn.tool_config_path = 'conf/tools.yaml': the tool config does not exist (looked at {tmp_path / 'conf/tools.yaml'}" in str(exc.value)


def test_no_tool_carried_with_multi_turn_on_says_so(tmp_path):
    (tmp_path / "sandbox_fusion_tool_config.yaml").write_text("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    config: {type: native}\n")
    src = tmp_path / "run.sh"
    src.write_text(RETOOL.read_text())
    with pytest.raises(UserError, match="names no tool postrl carries \\(verl.tools.search_tool.SearchTool\\)"):
        convert_file(src)


def test_a_custom_dataset_class_is_refused_by_name():
    with pytest.raises(UserError, match=r"data.custom_cls.path = 'recipe/retool/retool.py': verl builds the prompts with this dataset class"):
        convert_file(RETOOL, overrides=["data.custom_cls.path=recipe/retool/retool.py", "data.custom_cls.name=CustomRLHFDataset"])


# --------------------------------------------------------------------------------------- sapo / geo_mean
def _loss(name: str, mode: str, adv_row1: float) -> float:
    """Row 0: one token, A = +1; row 1: three tokens, A = adv_row1; on-policy (logp = old)."""
    logp = torch.full((2, 3), -1.0, dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [adv_row1] * 3], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=torch.float64)
    fn = get_policy_loss_fn(name)
    extra = {"tau_pos": 1.0, "tau_neg": 1.05} if name == "sapo" else {}
    loss_BT, _ = fn(logp, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, **extra)
    return float(aggregate_loss(loss_BT, mask, mode))


@pytest.mark.parametrize("loss_mode, adv_row1, verl_value, token_mean", [
    # sapo on-policy: gate sigmoid(0) x 4 / tau = 2 (A > 0, tau 1) or 2 / 1.05 (A <= 0): l = -2 on row 0, +2/1.05 on row 1's
    # three tokens; verl: seq-mean-token-mean = (-2 + 2/1.05) / 2; token-mean would be (-2 + 3 x 2/1.05) / 4
    ("sapo", -1.0, (-2 + 2 / 1.05) / 2, (-2 + 3 * 2 / 1.05) / 4),
    # geo_mean on-policy: s_i = 1, l_i = -A_i: -1 and +0.5; verl: mean over sequences; token-mean (-1 + 3 x 0.5) / 4
    ("geo_mean", -0.5, (-1 + 0.5) / 2, (-1 + 3 * 0.5) / 4),
])  # fmt: skip
def test_a_converted_sapo_or_geo_mean_trains_verls_aggregation(tmp_path, loss_mode, adv_row1, verl_value, token_mean):
    src = tmp_path / "run.sh"
    src.write_text(f"python3 -m verl.trainer.main_ppo {TINY} actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} "
                   "actor_rollout_ref.actor.loss_agg_mode=token-mean\n")  # fmt: skip
    conv = convert_file(src)
    cfg = build_config(conv.tree)
    assert (cfg.algorithm.policy_loss, cfg.algorithm.loss_agg_mode) == (loss_mode, "seq-mean-token-mean")
    assert _loss(loss_mode, cfg.algorithm.loss_agg_mode, adv_row1) == pytest.approx(verl_value, abs=1e-7)  # 1e-8 in lengths
    assert _loss(loss_mode, "token-mean", adv_row1) == pytest.approx(token_mean, abs=1e-7)  # what the script's mode would give
    [m] = [m for m in conv.mapped if m.source == "actor_rollout_ref.actor.loss_agg_mode"]
    assert m.targets == {} and m.note.startswith("ignored, as in verl: verl's compute_policy_loss_")


def test_errors_print_a_scripts_control_characters_as_escapes(tmp_path, capsys):
    src = tmp_path / "run.sh"
    src.write_text(f"python3 -m verl.trainer.main_ppo {TINY} actor_rollout_ref.rollout.n=$(echo '\x1b[2J')\n")  # a real ESC
    assert main(["convert-config", str(src)]) == 2
    printed = capsys.readouterr().out
    assert "\x1b[2J" not in printed and "\\x1b[2J" in printed
