"""The guides' configurations: MindSpeed-RL YAMLs and verl override lists in postrl's names (postrl.guides)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import tiny_overrides
from postrl.checks import load_config, validate_tree
from postrl.cli import main
from postrl.guides import convert_file, convert_verl, flatten, read_verl_overrides, render_yaml

INPUTS = Path(__file__).resolve().parent / "guides_inputs"
GUIDES = sorted(p for p in INPUTS.iterdir() if p.is_file())  # the seeds/ snippets: tests/test_guides_seeds.py


def _source_keys(path: Path) -> set[str]:
    """Every leaf key of a guide's file, as the converter names its source."""
    if path.suffix == ".yaml":
        tree = yaml.safe_load(path.read_text())
        keys = set()
        for top, value in tree.items():
            if isinstance(value, dict):
                keys |= {f"{top}.{k}" for k in flatten(value)}
            else:
                keys.add(top)
        return keys
    return {item.split("=", 1)[0] for item in read_verl_overrides(path.read_text())}


@pytest.mark.parametrize("path", GUIDES, ids=[p.name for p in GUIDES])
def test_every_key_is_mapped_or_listed_and_the_result_validates(path, tmp_path):
    conv = convert_file(path)
    seen = {m.source for m in conv.mapped} | {u.source.split("[", 1)[0] for u in conv.unmapped}
    assert _source_keys(path) - seen == set()
    assert not [u for u in conv.unmapped if "not in postrl's table" in u.instead]  # the guides' keys are all known
    out = tmp_path / "converted.yaml"
    assert main(["convert-config", str(path), "-o", str(out)]) == 0
    tree = yaml.safe_load(out.read_text())
    assert tree == conv.tree  # the comments do not change what the YAML says
    validate_tree(tree, str(out))  # validates
    text = out.read_text()
    assert text.count("# from ") == sum(1 for line in text.splitlines() if not line.lstrip().startswith("#") and ": " in line and not line.rstrip().endswith(":"))
    for u in conv.unmapped:
        assert f"#   {u.source} = " in text


def test_mindspeed_dapo_values():
    cfg = validate_tree(convert_file(INPUTS / "mindspeed_dapo_qwen25_32b.yaml").tree)
    a, t = cfg.algorithm, cfg.train
    assert (a.name, a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == ("dapo", 0.2, 0.28, "token-mean")
    assert (a.overlong_buffer.enable, a.overlong_buffer.len, cfg.rollout.max_tokens) == (True, 4096, 20480)
    assert (a.filter_groups.enable, a.filter_groups.metric, a.filter_groups.max_num_gen_batches) == (True, "acc_for_dapo", -1)
    # filter_groups_train_batch_size (32) trains, global_batch_size (256) generates
    assert (t.global_batch_size, t.gen_batch_size, t.mini_batch_size) == (32, 256, 32)
    assert (t.lr, t.betas, t.max_token_len_per_device, t.log_prob_max_token_len) == (1e-6, (0.9, 0.95), 22528, 45056)
    assert [(v.name, v.weight) for v in cfg.reward.verifiers] == [("acc_for_dapo", 1.0)]
    assert (cfg.model.path, cfg.model.dtype, cfg.rollout.tensor_parallel_size, cfg.rollout.max_num_batched_tokens) == (
        "./Qwen2.5-32B", "bfloat16", 4, 22528,
    )  # fmt: skip


def test_mindspeed_grpo_values():
    cfg = validate_tree(convert_file(INPUTS / "mindspeed_grpo_qwen25_7b.yaml").tree)
    a = cfg.algorithm
    assert (a.name, a.adv_estimator, a.kl.coef, a.kl.estimator, a.clip_ratio_low, a.clip_ratio_high) == ("grpo", "grpo", 0.001, "k3", 0.2, 0.2)
    assert (cfg.train.global_batch_size, cfg.train.gen_batch_size, cfg.train.log_prob_micro_batch_size) == (32, 32, 8)
    assert [v.name for v in cfg.reward.verifiers] == ["math_17k_acc"]
    assert cfg.logging.sinks == ["console", "jsonl", "tensorboard"]


def test_verl_dapo_values():
    cfg = validate_tree(convert_file(INPUTS / "verl_dapo_qwen25_32b.sh").tree)
    a, t = cfg.algorithm, cfg.train
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.kl.coef, a.loss_agg_mode) == (0.2, 0.28, 10.0, 0.0, "token-mean")
    assert (t.global_batch_size, t.gen_batch_size, t.mini_batch_size, t.total_steps, t.total_epochs) == (512, 1536, 32, 400, None)
    assert (t.max_token_len_per_device, t.log_prob_max_token_len, cfg.rollout.max_num_batched_tokens) == (22528, 45056, 22528)
    assert t.sequence_parallel_size == 8  # ulysses_sequence_parallel_size
    assert (cfg.checkpoint.save_freq, cfg.checkpoint.save_final) == (0, False)  # save_freq=-1: never
    assert (cfg.cluster.nnodes, cfg.cluster.devices_per_node, cfg.logging.dir) == (16, 8, "runs/DAPO-Qwen2.5-32B")
    assert [v.name for v in cfg.reward.verifiers] == ["verl_default"]  # DAPO manager: scored by data_source, as verl


def test_verl_combinations():
    # clip_ratio fills both sides unless one is given; use_kl_loss=true keeps verl's default coefficient
    flat = convert_verl(["actor_rollout_ref.actor.clip_ratio=0.25", "actor_rollout_ref.actor.clip_ratio_high=0.3"]).flat()
    assert (flat["algorithm.clip_ratio_low"], flat["algorithm.clip_ratio_high"]) == (0.25, 0.3)
    assert convert_verl(["actor_rollout_ref.actor.use_kl_loss=true"]).flat() == {"algorithm.kl.coef": 0.001}
    flat = convert_verl(["trainer.total_training_steps=200", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05"]).flat()
    assert flat["train.warmup_steps"] == 10
    conv = convert_verl(["+actor_rollout_ref.actor.use_torch_compile=false", "critic.optim.lr=1e-5"])
    assert [u.source for u in conv.unmapped] == ["actor_rollout_ref.actor.use_torch_compile", "critic.optim.lr"]


def test_verl_overrides_in_load_config(caplog):
    cfg = load_config(None, [
        "model.path=builtin:tiny-qwen2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", "algorithm.filter_groups.enable=true",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=8", "data.max_response_length=16",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true", "trainer.save_freq=-1", "data.train_files=builtin:arithmetic:train",
        "algorithm.kl_ctrl.kl_coef=0.0", "algorithm.use_kl_in_reward=False",
    ], check_paths=False)  # fmt: skip
    assert (cfg.train.global_batch_size, cfg.rollout.n_samples_per_prompt, cfg.algorithm.clip_ratio_high) == (4, 3, 0.28)
    assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.overlong_buffer.len, cfg.rollout.max_tokens) == (True, 8, 16)
    assert (cfg.checkpoint.save_freq, cfg.checkpoint.save_final, cfg.data.train_files) == (0, False, ["builtin:arithmetic:train"])
    assert "fsdp_config.param_offload" in caplog.text  # not applied, and said so
    assert (cfg.algorithm.kl_ctrl.kl_coef, cfg.algorithm.use_kl_in_reward) == (0.0, False)  # postrl keys too (PPO)


def test_verl_overrides_train_the_tiny_model(tmp_path):
    """A guide's command line (verl names) trains the tiny model 2 steps."""
    verl = [
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "data.max_response_length=12",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.val_before_train=False",
    ]  # fmt: skip
    native = [o for o in tiny_overrides(tmp_path) if o.split("=")[0] not in (
        "train.global_batch_size", "rollout.n_samples_per_prompt", "rollout.max_tokens", "train.micro_batch_size", "train.total_steps", "checkpoint.save_final",
    )]  # fmt: skip
    assert main(["train", "configs/tiny_grpo.yaml", *native, *verl]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/kl_loss"] >= 0 and r["timing/reference_model"] > 0 for r in rows)  # use_kl_loss took effect
    assert not list((tmp_path / "run" / "checkpoints").glob("iter_*"))  # save_freq=-1: never saved


def test_render_lists_unmapped_keys():
    conv = convert_verl(["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.use_torch_compile=true"])
    text = render_yaml(conv, "cmd")
    assert "n_samples_per_prompt: 8  # from actor_rollout_ref.rollout.n" in text
    assert "#   actor_rollout_ref.actor.use_torch_compile = True: postrl runs the model eagerly" in text


def test_docs_list_every_key_of_the_tables():
    from postrl.guides import MINDSPEED, MINDSPEED_PREFIXES, VERL, VERL_PREFIXES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "guides.md").read_text()
    missing = [k for k in [*VERL, *MINDSPEED] if f"| `{k}` |" not in doc]
    missing += [p for p in [*VERL_PREFIXES, *MINDSPEED_PREFIXES] if f"| `{p}*` |" not in doc]
    assert missing == []


def test_total_epochs_counts_steps_from_the_prompts(tmp_path):
    """verl's trainer.total_epochs: 1 epoch of 8 prompts at 4 per step is 2 steps."""
    args = [o for o in tiny_overrides(tmp_path) if not o.startswith(("train.total_steps", "data.builtin.train_size"))]
    assert main(["train", "configs/tiny_grpo.yaml", *args, "data.builtin.train_size=8", "trainer.total_epochs=1", "eval.freq=0"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the YAML's train.total_steps (20) is replaced


def test_verl_covariance_losses_keep_their_names_and_parameters():
    # verl's loss_mode names are postrl's registered policy losses; the covariance parameters keep verl's names
    cfg = load_config(None, [
        "model.path=builtin:tiny-qwen2", "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.02", "actor_rollout_ref.actor.policy_loss.clip_cov_ub=4.0",
    ], check_paths=False)  # fmt: skip
    assert cfg.algorithm.policy_loss == "clip_cov"
    assert (cfg.algorithm.policy_loss_args["clip_cov_ratio"], cfg.algorithm.policy_loss_args["clip_cov_ub"]) == (0.02, 4.0)
    flat = convert_verl(["actor_rollout_ref.actor.policy_loss.loss_mode=sapo"]).flat()
    assert flat["algorithm.policy_loss"] == "sapo"
    with pytest.raises(Exception, match="postrl's policy losses"):
        convert_verl(["actor_rollout_ref.actor.policy_loss.loss_mode=no_such_loss"])
