"""The guides' snippets as printed (tests/guides_inputs/seeds): each converts to what its text says, or is
refused with a message naming the line; convert-config's bad inputs end in exit 2 (issues 38, 41).

The seed files are RECONSTRUCTED from issue 38's quotes (the guides' own text was not available to the
session that wrote them); each file's header says which lines are quoted exactly.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from postrl import algorithms
from postrl.cli import main
from postrl.config import Config, build_config
from postrl.errors import UserError
from postrl.guides import MINDSPEED, MINDSPEED_PREFIXES, VERL, VERL_PREFIXES, convert_file, convert_verl, rules

SEEDS = Path(__file__).resolve().parent / "guides_inputs" / "seeds"
INPUTS = SEEDS.parent
ENV = {"DATA_DIR": "/data"}


def _out(capsys) -> str:
    """What the command printed, with rich's line wrapping undone."""
    return " ".join(capsys.readouterr().out.split())


def _resolved(name: str, **kw) -> Config:
    return build_config(convert_file(SEEDS / name, **kw).tree)


def _what(cfg: Config) -> tuple:
    a = cfg.algorithm
    return (a.name, a.adv_estimator, [v.name for v in cfg.reward.verifiers], a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high)


def test_seed001_verl_script_as_printed():
    """`trainer.total_training_steps=150 \\ # 原代码` crashed the converter (shlex); ${VAR} and $VAR expand."""
    conv = convert_file(SEEDS / "seed001_verl_grpo_script.sh", env=ENV)
    cfg = build_config(conv.tree)
    # verl runs GRPO with token-mean, clip 0.2 and its naive manager (scored by data_source) unless told otherwise
    assert _what(cfg) == ("grpo", "grpo", ["verl_default"], "token-mean", 0.2, 0.2)
    assert (cfg.algorithm.kl.coef, cfg.algorithm.kl.estimator, cfg.train.total_steps) == (0.001, "k3", 150)
    assert cfg.data.train_files == ["/data/gsm8k/train.parquet"] and cfg.data.val_files == ["/data/gsm8k/test.parquet"]
    assert cfg.model.path == "Qwen/Qwen2.5-7B-Instruct"  # the script's own MODEL_PATH
    assert (cfg.cluster.nnodes, cfg.cluster.devices_per_node) == (1, 8)
    assert any(n.startswith("line 46: `\\` followed by a comment") for n in conv.notes)
    assert any("line 6: MODEL_PATH=" in n for n in conv.notes)  # the script's variable: reported, not dropped
    assert not [u for u in conv.unmapped if "not in postrl's table" in u.instead]


def test_seed001_unset_variable_is_named_with_its_line():
    with pytest.raises(UserError) as exc:
        convert_file(SEEDS / "seed001_verl_grpo_script.sh", env={})
    assert "line 10: $DATA_DIR is not set" in str(exc.value) and "--env DATA_DIR=VALUE" in str(exc.value)


def test_seed002_flat_dapo_with_annotations_and_metric_name():
    conv = convert_file(SEEDS / "seed002_mindspeed_dapo_flat.yaml")
    cfg = build_config(conv.tree)
    assert _what(cfg) == ("dapo", "grpo", ["acc_for_dapo"], "token-mean", 0.2, 0.28)
    fg, ob = cfg.algorithm.filter_groups, cfg.algorithm.overlong_buffer
    assert (fg.enable, fg.metric, ob.enable, ob.len) == (True, "acc_for_dapo", True, 4096)  # the verifier's own score
    assert (cfg.train.global_batch_size, cfg.train.gen_batch_size) == (32, 256)
    assert sum("'<------- 默认关闭' after the value" in n for n in conv.notes) == 4
    # the same metric name passes config validation directly (it stopped the run at step 1 before)
    tree = {"model": {"path": "x"}, "algorithm": {"filter_groups": {"enable": True, "metric": "grpo/acc_for_dapo_rewards/mean"}}}
    assert build_config(tree).algorithm.filter_groups.metric == "acc_for_dapo"


def test_seed003_reward_manager_name_scores_by_data_source():
    cfg = _resolved("seed003_verl_vl_dapo_geo3k.sh")
    assert _what(cfg) == ("grpo", "grpo", ["verl_default"], "token-mean", 0.2, 0.28)
    assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.overlong_buffer.len, cfg.rollout.expert_parallel_size) == (True, 512, 1)
    from postrl.rewards.registry import get_entry

    score = get_entry("verl_default").fn
    assert score("<think>x</think> \\boxed{3}", "3", {"data_source": "hiyouga/geometry3k"}).score == 1.0  # geo3k's rule
    assert score("Answer: 4", "3", {"data_source": "math_dapo"}).score == -1.0  # DAPO's +1/-1 rule
    assert score("#### 3", "3", {"data_source": "openai/gsm8k"}).score == 1.0
    with pytest.raises(ValueError, match="no rule for data_source 'mine'"):
        score("x", "3", {"data_source": "mine"})


def test_seed004_annotated_false_and_the_new_keys():
    conv = convert_file(SEEDS / "seed004_mindspeed_grpo_annotated.yaml")
    cfg = build_config(conv.tree)
    assert _what(cfg) == ("grpo", "grpo", ["base_acc"], "seq-mean-token-mean", 0.2, 0.2)  # token_level_loss: false
    assert (cfg.train.deterministic, cfg.checkpoint.ref_model_path, cfg.checkpoint.resume) == (True, "./Qwen2.5-7B", "./ckpt")
    assert (cfg.cluster.nnodes, cfg.cluster.devices_per_node, cfg.world_size) == (2, 8, 16)
    assert (cfg.algorithm.kl.coef, cfg.algorithm.kl.estimator) == (0.001, "k3")


def test_seed000_resume_fragment_needs_a_base(tmp_path, capsys):
    frag = str(SEEDS / "seed000_mindspeed_resume.yaml")
    assert main(["convert-config", frag]) == 2
    assert "--base your_config.yaml" in _out(capsys)
    out = tmp_path / "resumed.yaml"
    assert main(["convert-config", frag, "--base", "configs/tiny_grpo.yaml", "-o", str(out)]) == 0
    cfg = build_config(yaml.safe_load(out.read_text()))
    assert (cfg.checkpoint.resume, cfg.checkpoint.dir, cfg.checkpoint.finetune, cfg.checkpoint.load_optimizer) == ("./ckpt", "./ckpt", False, True)
    base = build_config(yaml.safe_load(Path("configs/tiny_grpo.yaml").read_text()))
    assert (cfg.model.path, cfg.train.global_batch_size) == (base.model.path, base.train.global_batch_size)


@pytest.mark.parametrize("name, devices", [("mindspeed_grpo_qwen25_7b.yaml", 16), ("mindspeed_dapo_qwen25_32b.yaml", 64)])
def test_memory_estimate_answers_for_the_guides_device_count(name, devices, tmp_path, capsys):
    out = tmp_path / "c.yaml"
    assert main(["convert-config", str(INPUTS / name), "-o", str(out)]) == 0
    assert build_config(yaml.safe_load(out.read_text())).world_size == devices  # rl_config.actor_resource.num_npus
    capsys.readouterr()
    assert main(["check-config", str(out), "--no-path-check", "--device-memory", "64"]) == 0
    text = _out(capsys)
    assert f"fsdp2 over {devices} device(s)" in text


# ------------------------------------------------------------------------------ bad input (issue 41)
def _convert(tmp_path, text: str | bytes, *args: str) -> tuple[int, str]:
    src = tmp_path / "in.sh"
    src.write_bytes(text if isinstance(text, bytes) else text.encode())
    return main(["convert-config", str(src), *args]), str(src)


def test_every_line_is_mapped_listed_or_refused(tmp_path, capsys):
    base = "actor_rollout_ref.model.path=m\n"
    code, _ = _convert(tmp_path, base + "actor_rollout_ref.rollout.n 16\n")
    assert code == 2 and "line 2: 'actor_rollout_ref.rollout.n 16' is written `key value`" in _out(capsys)
    code, _ = _convert(tmp_path, base + "actor_rollout_ref.rollout.n=8\nactor_rollout_ref.rollout.n=16\n")
    assert code == 2 and "lines 2 and 3: actor_rollout_ref.rollout.n is given twice" in _out(capsys)
    code, _ = _convert(tmp_path, base + "actor_rollout_ref.rollout.n=8\nactor_rollout_ref.rollout.n=8\n", "-o", str(tmp_path / "o.yaml"))
    assert code == 0 and "line 3: actor_rollout_ref.rollout.n repeats line 2" in (tmp_path / "o.yaml").read_text()
    src = tmp_path / "list.yaml"
    src.write_text("- actor_rollout_ref.model.path=m\n- actor_rollout_ref.rollout.n\n")
    assert main(["convert-config", str(src)]) == 2
    assert "line 2: item 'actor_rollout_ref.rollout.n' is not of the form key=value" in _out(capsys)


def test_values_that_are_not_what_their_key_takes_are_refused_with_the_line(tmp_path, capsys):
    src = tmp_path / "ms.yaml"
    src.write_text("megatron_training:\n  tokenizer_name_or_path: m\nrl_config:\n  token_level_loss: maybe\n  adv_estimator: opo\n")
    assert main(["convert-config", str(src)]) == 2
    text = _out(capsys)
    assert "line 4: rl_config.token_level_loss = 'maybe': 'maybe' is not a boolean" in text
    assert "line 5: rl_config.adv_estimator = 'opo'" in text  # not silently GRPO
    src.write_text("megatron_training:\n  tokenizer_name_or_path: m\nactor_config:\n  micro_batch_size: 4 NPUs\n")
    assert main(["convert-config", str(src)]) == 2  # a value the schema refuses names the line it came from
    assert "got '4 NPUs'" in (text := _out(capsys)) and "It came from line 4: actor_config.micro_batch_size" in text
    with pytest.raises(UserError, match="loss_mode = 'mine'"):
        convert_verl(["actor_rollout_ref.actor.policy_loss.loss_mode=mine"])


def test_binary_directory_and_output_paths(tmp_path, capsys):
    code, _ = _convert(tmp_path, b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert code == 2 and "is not a text file" in _out(capsys)
    assert main(["convert-config", str(tmp_path)]) == 2
    assert "is a directory" in _out(capsys)
    code, _ = _convert(tmp_path, "actor_rollout_ref.model.path=m\n", "-o", str(tmp_path / "new" / "dir" / "c.yaml"))
    assert code == 0 and (tmp_path / "new" / "dir" / "c.yaml").is_file()  # a missing directory is made
    code, _ = _convert(tmp_path, "actor_rollout_ref.model.path=m\n", "-o", str(tmp_path / "in.sh" / "c.yaml"))
    assert code == 2 and "cannot write" in _out(capsys)  # under a file: refused, no traceback


def test_overrides_after_the_file_apply_or_refuse(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DATA_DIR", raising=False)
    out = tmp_path / "c.yaml"
    args = ["convert-config", str(INPUTS / "verl_dapo_qwen25_32b.sh"), "actor_rollout_ref.rollout.n=4", "train.seed=7", "-o", str(out)]
    assert main(args) == 0
    cfg = build_config(yaml.safe_load(out.read_text()))
    assert (cfg.rollout.n_samples_per_prompt, cfg.train.seed) == (4, 7)
    ms = ["convert-config", str(INPUTS / "mindspeed_grpo_qwen25_7b.yaml"), "rl_config.clip_ratio=0.3", "-o", str(out)]
    assert main(ms) == 0 and build_config(yaml.safe_load(out.read_text())).algorithm.clip_ratio_high == 0.3
    assert main(["convert-config", str(INPUTS / "verl_dapo_qwen25_32b.sh"), "no.such_key=1"]) == 2
    assert "names neither a key of" in _out(capsys)
    assert main(["convert-config", str(SEEDS / "seed001_verl_grpo_script.sh"), "--env", "DATA_DIR"]) == 2
    assert "--env DATA_DIR: DATA_DIR is not set in your environment" in _out(capsys)  # --env NAME alone reads it from there
    assert main(["convert-config", str(SEEDS / "seed001_verl_grpo_script.sh"), "--env", "DATA-DIR=/d"]) == 2
    assert "--env DATA-DIR=/d: not of the form NAME=VALUE or NAME" in _out(capsys)
    assert main(["convert-config", str(SEEDS / "seed001_verl_grpo_script.sh"), "--env", "DATA_DIR=/d", "-o", str(out)]) == 0
    assert build_config(yaml.safe_load(out.read_text())).data.train_files == ["/d/gsm8k/train.parquet"]


# ------------------------------------------------------------------------------ the tables' words
_KEY = re.compile(r"\b(?:model|data|rollout|algorithm|reward|train|critic|sft|rm|checkpoint|eval|logging|guards|cluster)(?:\.[a-z_]+)+")


def _exists(dotted: str) -> bool:
    """A key or section of postrl's config schema (optional sections included), or a hyperparameter a registered
    policy loss declares under `algorithm.policy_loss_args` (a mapping the config checks against the loss)."""
    section, _, arg = dotted.rpartition(".")
    if section == "algorithm.policy_loss_args":
        return any(arg in algorithms.policy_loss_spec(fn).params for fn in algorithms.POLICY_LOSSES.values())
    cls: typing.Any = Config
    for part in dotted.split("."):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return False
        ann = cls.model_fields[part].annotation
        args = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union else ()
        cls = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), ann)
    return True


def test_every_postrl_key_a_table_names_exists():
    texts = [r.note for r in (*VERL.values(), *MINDSPEED.values())] + [*VERL_PREFIXES.values(), *MINDSPEED_PREFIXES.values()]
    texts += [r.to for r in (*VERL.values(), *MINDSPEED.values()) if isinstance(r.to, str)]
    texts += [v for k, v in vars(rules).items() if k.isupper() and isinstance(v, str)]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "guides.md").read_text()
    texts += [line.split(" | ", 1)[1] for line in doc.splitlines() if line.startswith("| `")]  # the postrl and note columns
    named = {k for t in texts for k in _KEY.findall(t)}
    assert len(named) > 60
    assert sorted(k for k in named if not _exists(k)) == []


def test_verl_config_as_yaml_and_broken_yaml(tmp_path):
    src = tmp_path / "verl.yaml"
    src.write_text("actor_rollout_ref:\n  model:\n    path: m\n  rollout:\n    n: 4\nalgorithm:\n  adv_estimator: rloo\n")
    cfg = build_config(convert_file(src).tree)
    assert (cfg.rollout.n_samples_per_prompt, cfg.algorithm.adv_estimator, cfg.algorithm.loss_agg_mode) == (4, "rloo", "token-mean")
    src.write_text("a: [\n")
    with pytest.raises(UserError, match="is not valid YAML"):
        convert_file(src)


def test_context_parallel_maps_where_it_is_ulysses():
    from postrl.guides import convert_mindspeed

    tree = {"megatron_training": {"tokenizer_name_or_path": "m", "context_parallel_size": 2}}
    assert convert_mindspeed(tree).flat()["train.sequence_parallel_size"] == 2  # MindSpeed's default algo: Ulysses
    tree["megatron_training"]["context_parallel_algo"] = "megatron_cp_algo"
    conv = convert_mindspeed(tree)
    assert "train.sequence_parallel_size" not in conv.flat()
    assert [u.source for u in conv.unmapped if "ring attention" in u.instead] == ["megatron_training.context_parallel_size"]
