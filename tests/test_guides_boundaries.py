"""What a converted script may decide, second pass of issue 64: every user-given YAML is read by the one bounded
loader (postrl.yaml_bounded), a script value that names a place the run writes to is plain or refused, a URL
the model's code is sent to is listed and waits for --allow-code, and Hydra's --config-name / --config-path
read the script against the defaults verl would use, or are refused by name."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl.cli import _from_script, main
from postrl.config import parse_overrides, read_config
from postrl.errors import UserError
from postrl.guides import convert_file, convert_verl, render_yaml, sends_keys
from postrl.yaml_bounded import MAX_DEPTH, MAX_NODES, TooLarge, load

TINY = "actor_rollout_ref.model.path=builtin:tiny-qwen2 data.train_files=builtin:arithmetic:train"
BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 7))
DEEP = "model:\n  path: " + "[" * 10_000 + "]" * 10_000 + "\n"
SELF = "model: &m {path: [*m]}\n"


def _out(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------------------- YAML bounds
@pytest.mark.parametrize("text, why", [(BOMB, f"expand to more than {MAX_NODES:,} values"), (DEEP, f"nests more than {MAX_DEPTH} levels"),
                                       (SELF, "stands inside the anchor it names")])  # fmt: skip
def test_every_user_yaml_is_refused_the_same_way(tmp_path, capsys, text, why):
    """A 6-level alias bomb (9^7 = 4.8M values), 10,000-deep nesting and a self-referencing alias: a config file,
    --base of convert-config, a verl config YAML and a command-line value give the same one-paragraph refusal."""
    assert 9**7 > 40 * MAX_NODES
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(UserError) as exc:
        read_config(cfg)
    assert exc.value.problems == [f"{cfg}: {exc.value.problems[0].split(': ', 1)[1]}"] and why in exc.value.problems[0]
    assert "Fix: write the values out" in exc.value.problems[0]
    src = tmp_path / "run.sh"
    src.write_text(f"python3 -m verl.trainer.main_ppo {TINY}\n")
    assert main(["convert-config", str(src), "--base", str(cfg)]) == 2 and why in _out(capsys)
    verl_yaml = tmp_path / "verl.yaml"
    verl_yaml.write_text("trainer: {total_epochs: 1}\n" + text)
    with pytest.raises(UserError, match=why):
        convert_file(verl_yaml)
    flow = text.split(": ", 1)[1] if text is DEEP else "[" + ", ".join(f"&b{i} [" + ", ".join([f"*b{i - 1}" if i else "1"] * 9) + "]" for i in range(7)) + "]"
    with pytest.raises(UserError, match="expand to more than|nests more than"):
        parse_overrides([f"model.path={flow}"])


@settings(max_examples=80, deadline=3000)
@given(st.integers(1, 8), st.integers(1, 12), st.integers(1, 150))
def test_generated_alias_trees_load_or_are_refused(levels, width, depth):
    """Alias fan-outs and nestings of every size: loaded exactly when the expansion and the depth are within the bounds."""
    text = f"a0: &a0 {'[' * depth}1{']' * depth}\n" + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]\n" for i in range(1, levels))
    sizes = [depth + 1]  # a0: `depth` lists around one scalar
    for _ in range(1, levels):
        sizes.append(1 + width * sizes[-1])  # a_i: a list of `width` copies of a_(i-1)
    expanded = 1 + sum(1 + n for n in sizes)  # the mapping, each key and its value
    within = expanded <= MAX_NODES and depth + 2 <= MAX_DEPTH  # the mapping, `depth` lists, the scalar
    try:
        tree = load(text)
    except TooLarge:
        assert not within
        return
    assert within and len(tree) == levels


# ------------------------------------------------------------------------------------------- paths the run writes to
@pytest.mark.parametrize("name", ["../x", "/etc/x", "a/b", "..", ".", "x\nrollout.agent: y", "x\x1b[2J", "x\u202ey", "a\\b", "x" * 256])
def test_an_experiment_name_that_is_not_one_plain_name_is_refused(name):
    with pytest.raises(UserError) as exc:
        convert_verl({"actor_rollout_ref.model.path": "m", "trainer.experiment_name": name})
    (problem,) = exc.value.problems
    assert problem.startswith(f"trainer.experiment_name = {name!r}: the run would write to a place named by it")
    assert "\n" not in problem and "\x1b" not in problem and "\u202e" not in problem  # named escaped


@settings(max_examples=200, deadline=2000)
@given(st.text(max_size=30), st.text(max_size=30))
def test_a_converted_run_writes_only_under_plain_places(name, local_dir):
    """Whatever the script says: refused, or logging.dir is runs/<one printable name> and checkpoint.dir has no `..`."""
    try:
        conv = convert_verl({"actor_rollout_ref.model.path": "m", "trainer.experiment_name": name, "trainer.default_local_dir": local_dir})
    except UserError as exc:
        assert all("trainer." in p for p in exc.problems)
        return
    run_dir, ckpt = conv.tree["logging"]["dir"], str(conv.tree["checkpoint"]["dir"])  # 0E0 is read as a number
    parts = run_dir.split("/")
    assert len(parts) == 2 and parts[0] == "runs" and parts[1] not in ("", ".", "..") and run_dir.isprintable()
    assert ".." not in ckpt.replace("\\", "/").split("/") and ckpt.isprintable() and ckpt.strip()


def test_a_plain_name_and_an_absolute_checkpoint_dir_are_listed_as_written(tmp_path):
    conv = convert_verl({"actor_rollout_ref.model.path": "m", "trainer.experiment_name": "qwen2.5-7b_dapo-实验",
                         "trainer.default_local_dir": "/data/ckpts/dapo"})  # fmt: skip
    text = render_yaml(conv, "run.sh")
    assert (conv.tree["logging"]["dir"], conv.tree["checkpoint"]["dir"]) == ("runs/qwen2.5-7b_dapo-实验", "/data/ckpts/dapo")
    assert "# Writes to (2)" in text and "#   checkpoint.dir = '/data/ckpts/dapo'" in text


# ------------------------------------------------------------------------------------------- sends data to
def _sandbox_script(tmp_path: Path, url: str) -> Path:
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
        f"    config: {{sandbox_fusion_url: '{url}', type: native}}\n"
    )
    src = tmp_path / "run.sh"
    src.write_text(f"python3 -m verl.trainer.main_ppo {TINY} actor_rollout_ref.rollout.multi_turn.enable=True "
                   f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'} trainer.logger=['console','wandb']\n")  # fmt: skip
    return src


@pytest.mark.parametrize("url, where", [("http://sandbox.example.org:8080/run_code", "another machine (not loopback)"),
                                        ("http://127.0.0.1:8080/run_code", "this machine (loopback)")])  # fmt: skip
def test_a_sandbox_url_is_listed_and_waits_for_allow_code(tmp_path, capsys, monkeypatch, url, where):
    monkeypatch.chdir(tmp_path)
    src = _sandbox_script(tmp_path, url)
    conv = convert_file(src)
    assert [(k, v, gated) for k, v, _, gated in sends_keys(conv.tree)] == [
        ("rollout.multi_turn.sandbox.url", url.removesuffix("/run_code"), True), ("logging.sinks", "wandb", False)]
    assert main(["convert-config", str(src)]) == 0
    printed = _out(capsys)
    assert "# Sends data to (2)" in printed and f"SandboxFusion service, on {where}, which runs it (asks for --allow-code)" in printed
    assert main(["train", str(src)]) == 2
    printed = _out(capsys)
    assert "sets 1 setting(s) that run code other than postrl's or send the model's code away" in printed
    assert not (tmp_path / "runs").exists()
    cfg, _ = _from_script(argparse.Namespace(config=str(src), env=[], overrides=["trainer.logger=[console]"], allow_code=True))
    assert cfg.rollout.multi_turn.sandbox.url == url.removesuffix("/run_code")


# ------------------------------------------------------------------------------------------- Hydra's base config
def _hydra(tmp_path: Path, flags: str, defaults: str = "[ppo_trainer, _self_]") -> Path:
    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "multiturn.yaml").write_text(
        f"hydra: {{searchpath: ['file://verl/trainer/config']}}\ndefaults: {defaults}\n"
        "data: {max_prompt_length: 1024, train_batch_size: 256}\nactor_rollout_ref: {rollout: {n: 8, multi_turn: {max_assistant_turns: 5}}}\n"
    )
    src = tmp_path / "run.sh"
    src.write_text(f'CONFIG_PATH="$PWD/cfg"\npython3 -m verl.trainer.main_ppo {flags} \\\n  {TINY} data.train_batch_size=64\n')
    return src


def test_a_config_starting_from_ppo_trainer_is_read_and_the_script_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conv = convert_file(_hydra(tmp_path, "--config-path=\"$CONFIG_PATH\" --config-name 'multiturn'"))
    flat = conv.flat()
    assert (flat["data.max_prompt_length"], flat["train.global_batch_size"], flat["rollout.n_samples_per_prompt"], flat["rollout.multi_turn.max_turns"]) == (1024, 64, 8, 5)
    assert any("multiturn.yaml read (4 keys, from verl's ppo_trainer)" in n for n in conv.notes)


@pytest.mark.parametrize("flags, defaults, why", [
    ("--config-name=sft_trainer", None, "--config-name 'sft_trainer' is not one of verl's configs postrl knows"),
    ("-cp cfg -cn multiturn", None, "does not exist (Hydra reads a relative --config-path from the directory of the module"),
    ("--config-path=$CONFIG_PATH --config-name=multiturn", "[ppo_trainer, {actor@actor_rollout_ref.actor: megatron_actor}, _self_]",
     "starts from defaults"),
    ("--config-path=$CONFIG_PATH --config-name=multiturn", "[_self_, ppo_trainer]", "starts from defaults"),
    ("--config-dir=/x", None, "--config-dir '/x' adds a directory of configs"),
    ("--config-name=$(cat name.txt)", None, "--config-name takes a value that comes from"),
])  # fmt: skip
def test_other_base_configs_are_refused_naming_the_flag(tmp_path, monkeypatch, flags, defaults, why):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"line 2: .*" if "$(" not in flags else "line 2") as exc:
        convert_file(_hydra(tmp_path, flags, defaults or "[ppo_trainer, _self_]"))
    assert why in " ".join(exc.value.problems)


@pytest.mark.parametrize("flags", ["--config-name=ppo_trainer", "--config-name=ppo_megatron_trainer",
                                   "--config-path=config --config-name='ppo_megatron_trainer.yaml'",  # verl's shipped Megatron scripts
                                   "-cp ./config -cn ppo_trainer"])  # fmt: skip
def test_verl_own_config_names_keep_verls_defaults(tmp_path, monkeypatch, flags):
    monkeypatch.chdir(tmp_path)  # no verl checkout here: verl's own configs are known, not read
    conv = convert_file(_hydra(tmp_path, flags))
    assert (conv.flat()["algorithm.loss_agg_mode"], conv.flat()["train.global_batch_size"]) == ("token-mean", 64)
    assert yaml.safe_load(render_yaml(conv, "run.sh")) == conv.tree
