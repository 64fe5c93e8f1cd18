"""verl's launch scripts as verl ships them (issue 48): arithmetic, `case` / `if` on known values, commands that
postrl does not run, the fully_async entry point. The scripts in tests/guides_inputs/verl were written for these
tests in the style of verl's examples/grpo_trainer and recipe/dapo shells and its fully_async_policy shells."""

from __future__ import annotations

from pathlib import Path

import pytest

from postrl.config import build_config
from postrl.errors import UserError
from postrl.guides import convert_file
from postrl.guides.script import read_script
from postrl.guides.shell import Scope, ShellError, arithmetic, case_matches, expand

SCRIPTS = Path(__file__).resolve().parent / "guides_inputs" / "verl"
HOME = {"HOME": "/home/u"}


def _cfg(name: str, **env: str):
    return build_config(convert_file(SCRIPTS / name, env={**HOME, **env}).tree)


def _what(cfg) -> tuple:
    a = cfg.algorithm
    return (a.name, a.adv_estimator, a.policy_loss, a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high)


# ------------------------------------------------------------------------------------------ the shell
@pytest.mark.parametrize("expr, value", [
    ("1024 * 4", 4096), ("(2048 + 8192) * 2", 20480), ("-7 / 2", -3), ("-7 % 3", -1), ("7 % -3", 1),
    ("- (3 - 5)", 2), ("a * b - 1", 11), ("$a + ${b}", 7), ("$(( a * 2 )) + 1", 7), ("e", 12),
])  # fmt: skip
def test_arithmetic_evaluates_as_the_shell(expr, value):
    scope = Scope({"a": "3", "b": "4", "e": "a * b"})  # a variable holding an expression is evaluated, as bash does
    assert arithmetic(expand(expr, scope, 1), scope, 1) == value
    assert expand(f"x=$(({expr}))", scope, 1) == f"x={value}"


@pytest.mark.parametrize("expr", ["2 ** 3", "__import__('os').getpid()", "a.real", "[1][0]", "1 if 1 else 2", "1 / 0", "3.5 * 2", "a < b"])
def test_arithmetic_runs_nothing_else(expr):
    scope = Scope({"a": "3", "b": "4"})
    with pytest.raises(ShellError):
        arithmetic(expr, scope, 1)


def test_a_value_computed_from_a_command_is_unknown_not_run(tmp_path):
    marker = tmp_path / "ran"
    scope = Scope({})
    word = expand(f"n=$(( $(touch {marker}; echo 3) * 2 ))", scope, 5)
    assert not marker.exists()  # nothing ran
    [u] = scope.unknowns_in(word)
    assert u.what.startswith("the command `touch") and u.line == 5


@pytest.mark.parametrize("value, patterns, hit", [
    ("npu", ["npu"], True), ("ascend", ["npu", "ascend"], True), ("gpu", ["npu"], False), ("gpu", ["*"], True),
    ("cuda12", ["cuda*"], True), ("a*", ["'a*'"], True), ("ab", ["'a*'"], False), ("h100", ["h[0-9]*"], True),
])  # fmt: skip
def test_case_patterns_are_shell_globs(value, patterns, hit):
    assert case_matches(value, patterns) is hit


def test_case_takes_the_shells_branch_and_if_too():
    text = """D=${D:-gpu}
case "$D" in
  npu|ascend) mode=a ;;
  g*)
    mode=b
    if [ "$mode" != "b" ]; then mode=c; elif [ -n "$D" ]; then mode=d; else mode=e; fi
    ;;
  *) mode=f ;;
esac
python3 -m verl.trainer.main_ppo trainer.experiment_name=$mode
"""
    assert [(i.key, i.value) for i in read_script(text).items] == [("trainer.experiment_name", "d")]
    assert [i.value for i in read_script(text, {"D": "ascend"}).items] == ["a"]
    assert [i.value for i in read_script(text, {"D": "tpu"}).items] == ["f"]


# ---------------------------------------------------------------------------------------- the scripts
def test_grpo_qwen3_8b_script():
    conv = convert_file(SCRIPTS / "grpo_qwen3_8b.sh", env=HOME)
    cfg = build_config(conv.tree)
    assert _what(cfg) == ("grpo", "grpo", "vanilla", "token-mean", 0.2, 0.2)  # verl's defaults where the script names none
    assert (cfg.algorithm.kl.coef, cfg.algorithm.kl.estimator) == (0.001, "k3")
    assert (cfg.train.global_batch_size, cfg.train.mini_batch_size, cfg.train.micro_batch_size, cfg.rollout.max_tokens) == (1024, 256, 32, 1024)
    assert (cfg.rollout.placement, cfg.rollout.max_staleness, cfg.data.train_files) == ("colocated", 0, ["/home/u/data/gsm8k/train.parquet"])


def test_grpo_qwen25_vl_script_takes_its_argument_default():
    cfg = _cfg("grpo_qwen25_vl_7b.sh")  # ENGINE=${1:-vllm}: no argument, so vllm
    assert (cfg.rollout.engine, cfg.data.image_key, cfg.algorithm.kl.coef, cfg.train.global_batch_size) == ("vllm", "images", 0.01, 512)
    assert _what(cfg) == ("grpo", "grpo", "vanilla", "token-mean", 0.2, 0.2)


def test_qwen3_30b_a3b_script_arithmetic_and_dated_names():
    conv = convert_file(SCRIPTS / "grpo_qwen3_30b_a3b.sh", env=HOME)
    cfg = build_config(conv.tree)
    assert _what(cfg) == ("grpo", "grpo", "gspo", "seq-mean-token-mean", 0.0003, 0.0004)
    # (2048 + 6144) * 2, then $actor_ppo_max_token_len * 3 / 2, and 256 / 4
    assert (cfg.train.max_token_len_per_device, cfg.train.log_prob_max_token_len, cfg.rollout.max_num_batched_tokens) == (16384, 24576, 8192)
    assert (cfg.train.mini_batch_size, cfg.rollout.expert_parallel_size, cfg.rollout.max_tokens) == (64, 4, 6144)
    # $(date ...) in names: a placeholder with a note that says how to choose the name
    assert (cfg.logging.dir, cfg.checkpoint.dir) == ("runs/gspo-fsdp-date", "/home/u/ckpts/qwen3-30b-a3b/gspo-fsdp-date_date")
    assert any("trainer.experiment_name: the command `date +%m%d` (line 7) is not run" in n and "--env EXPERIMENT_NAME=" in n for n in conv.notes)
    named = build_config(convert_file(SCRIPTS / "grpo_qwen3_30b_a3b.sh", env={**HOME, "EXPERIMENT_NAME": "mine", "NOW": "t0"}).tree)
    assert (named.logging.dir, named.checkpoint.dir) == ("runs/mine", "/home/u/ckpts/qwen3-30b-a3b/mine_t0")


def test_dapo_script_overlong_buffer_by_arithmetic():
    cfg = _cfg("dapo_overlong.sh")
    a, t = cfg.algorithm, cfg.train
    assert _what(cfg) == ("grpo", "grpo", "vanilla", "token-mean", 0.2, 0.28)
    assert (a.overlong_buffer.enable, a.overlong_buffer.len, a.overlong_buffer.penalty_factor, cfg.rollout.max_tokens) == (True, 4096, 1.0, 8192)
    assert (a.filter_groups.enable, a.filter_groups.metric, a.filter_groups.max_num_gen_batches, a.clip_ratio_c) == (True, "acc", 10, 10.0)
    assert (t.global_batch_size, t.gen_batch_size, t.mini_batch_size) == (512, 1536, 32)  # gen = $((train_prompt_bsz * 3))
    assert (t.max_token_len_per_device, t.log_prob_max_token_len, cfg.rollout.max_num_batched_tokens) == (20480, 30720, 10240)
    assert [v.name for v in cfg.reward.verifiers] == ["verl_default"]


@pytest.mark.parametrize("device, loss_mode, trainer_devices, replicas", [("npu", "seq-mean-token-mean", 8, 4), ("gpu", "token-mean", 4, 2)])
def test_fully_async_script_onto_the_pool(device, loss_mode, trainer_devices, replicas):
    cfg = _cfg("fully_async_device.sh", DEVICE=device)
    r, t = cfg.rollout, cfg.train
    assert _what(cfg) == ("grpo", "grpo", "vanilla", loss_mode, 0.2, 0.28)  # the case's branch for the device
    assert (r.placement, r.mode, r.max_staleness, r.partial_rollout) == ("pool", "async", 1, True)  # ceil(0.5)
    assert (r.pool.replicas, r.pool.devices_per_replica) == (replicas, 2)  # half the node, tensor parallel 2
    assert cfg.cluster.devices_per_node == trainer_devices
    # 4 syncs' worth of local updates of 2 x 32 prompts per step; 12800 prompts to generate
    assert (t.global_batch_size, t.mini_batch_size, t.total_steps, t.max_token_len_per_device) == (256, 32, 50, 20480)
    assert cfg.eval.freq == 10


def test_fully_async_notes_what_has_no_counterpart():
    conv = convert_file(SCRIPTS / "fully_async_device.sh", env={**HOME, "DEVICE": "gpu"})
    unmapped = {u.source: u.instead for u in conv.unmapped}
    assert "algorithm.rollout_correction" in unmapped["async_training.use_rollout_log_probs"]
    silent = {m.source: m.note for m in conv.mapped if not m.targets}
    assert "not effective under fully_async" in silent["data.train_batch_size"]
    assert any(n.startswith("line 23: `if [ \"$rollout_mode\" = \"async\" ]` is true") for n in conv.notes)


def test_device_from_a_command_is_refused_naming_the_env_that_settles_it():
    with pytest.raises(UserError) as exc:
        convert_file(SCRIPTS / "fully_async_device.sh", env=HOME)
    text = str(exc.value)
    assert "line 55: actor_rollout_ref.actor.loss_agg_mode takes a value that comes from the command `python3 -c 'import torch_npu'" in text
    assert "through the case at line 9" in text and "pass --env DEVICE=VALUE" in text and "among: npu, ascend" in text
    assert "trainer.experiment_name" not in text  # only names it: a placeholder, not a refusal


def test_fully_async_keys_under_another_entry_point_are_listed():
    conv = convert_file(SCRIPTS / "grpo_qwen3_8b.sh", env=HOME, overrides=["async_training.staleness_threshold=0.5"])
    [u] = [u for u in conv.unmapped if u.source == "async_training.staleness_threshold"]
    assert "this script runs verl.trainer.main_ppo" in u.instead
    assert build_config(conv.tree).rollout.placement == "colocated"


def test_unset_variable_in_a_branch_postrl_cannot_choose(tmp_path):
    src = tmp_path / "run.sh"
    src.write_text('if [ -d /some/dir ]; then\n  lr=1e-5\nelse\n  lr=1e-6\nfi\npython3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=m '
                   'actor_rollout_ref.actor.optim.lr=$lr\n')  # fmt: skip
    with pytest.raises(UserError, match=r"line 6: actor_rollout_ref.actor.optim.lr takes a value that comes from the condition `\[ -d /some/dir \]`"):
        convert_file(src)


def test_orchestration_lines_do_not_block_the_keys(tmp_path):
    """SLURM / Ray lines around the trainer's command (arrays, loops, echo of unset variables) decide nothing
    postrl converts; a parameter edit `${VAR//a/b}` is evaluated (a literal pattern)."""
    src = tmp_path / "run.sh"
    src.write_text("""nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
nodes_array=($nodes)
head_node=${nodes_array[0]}
echo "Using $SLURM_NNODES nodes"
for ((i = 1; i <= 3; i++)); do
  srun -w "${nodes_array[$i]}" ray start --address "$head_node" &
done
ACTOR="actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28"
REF="${ACTOR//clip_ratio/ppo_epochs_not}"
cat > runtime_env.yaml <<EOF
env_vars:
  actor_rollout_ref.actor.clip_ratio_low=0.5 don't
EOF
python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=m $ACTOR trainer.experiment_name=${#ACTOR}
""")
    conv = convert_file(src)
    flat = conv.flat()
    length = len("actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28")
    assert (flat["algorithm.clip_ratio_low"], flat["algorithm.clip_ratio_high"], flat["logging.dir"]) == (0.2, 0.28, f"runs/{length}")
    src.write_text(src.read_text() + "python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=$head_node\n")
    with pytest.raises(UserError, match=r"line 15: actor_rollout_ref.model.path takes a value that comes from `\$\{nodes_array\[0\]\}`"):
        convert_file(src)


def test_convert_config_exits_2_naming_the_env(capsys, tmp_path):
    from postrl.cli import main

    script = str(SCRIPTS / "fully_async_device.sh")
    assert main(["convert-config", script, "--env", "HOME=/h"]) == 2
    assert "--env DEVICE=VALUE" in " ".join(capsys.readouterr().out.split())
    out = tmp_path / "c.yaml"
    assert main(["convert-config", script, "--env", "HOME=/h", "--env", "DEVICE=npu", "-o", str(out)]) == 0
    assert "placement: pool" in out.read_text()
