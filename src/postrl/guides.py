"""The guides' configurations in postrl's names: verl override lists and MindSpeed-RL YAMLs.

Users of the MindSpeed-RL / verl guides carry settings such as `actor_rollout_ref.rollout.n=16` or
`rl_config.clip_higher_enable: true`. One table per dialect says, for every key the guides use,
which postrl key it becomes (and how its value is translated) or why it has no postrl counterpart
and what postrl offers instead. `postrl convert-config` writes the translated YAML, and `postrl
train` accepts verl-style dotted overrides through the same table (`config.load_config`).

A conversion returns a `Conversion`: the postrl tree, one `Mapped` record per source key that was
translated, and one `Unmapped` record per key that was not, so that no key is silently lost. The
table is documented in docs/guides.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from postrl.errors import UserError

# ------------------------------------------------------------------------------ what postrl offers instead
PARALLEL = "FSDP2 shards parameters, gradients and optimizer state over every rank, so model-parallel sizes are unnecessary (train.strategy: fsdp2; rollout.tensor_parallel_size for vLLM)"
FUSED = "a fused kernel switch: postrl runs the Hugging Face model's own modules; model.attn_implementation (auto) picks flash attention where it is installed"
MEGATRON = "a Megatron-LM training switch with no meaning for a Hugging Face model trained with FSDP2 / DDP"
ARCH = "model architecture: postrl reads it from the model's config.json (model.path)"
PLACEMENT = "Ray placement of separate workers: postrl colocates every role (rollout, reference, actor) on each device"
ASCEND = "an Ascend / MindSpeed runtime switch; on Ascend postrl runs the NPU through torch.distributed (train.device: npu)"
GAE = "a critic setting postrl does not map: set its critic section (critic.lr, critic.cliprange_value, critic.warmup_steps, critic.model_path)"
LOGGING = "logging detail; postrl logs its metrics to logging.sinks (logging.metric_names picks the guide's names)"
WRAP = "postrl shards one FSDP2 unit per transformer block (the model's _no_split_modules, as verl's default transformer-layer policy); a size-based wrap policy is not offered"
DATA = "postrl trains on parquet / JSONL in the verl schema: run `postrl preprocess` (e.g. `postrl preprocess math_17k`) and set data.train_files"


@dataclass
class Mapped:
    source: str
    value: Any
    targets: dict[str, Any]
    note: str = ""


@dataclass
class Unmapped:
    source: str
    value: Any
    instead: str


@dataclass
class Conversion:
    dialect: str
    tree: dict = field(default_factory=dict)
    mapped: list[Mapped] = field(default_factory=list)
    unmapped: list[Unmapped] = field(default_factory=list)

    def flat(self) -> dict[str, Any]:
        """The translated postrl keys in order, dotted (a later source key wins, as on a command line)."""
        out: dict[str, Any] = {}
        for m in self.mapped:
            out.update(m.targets)
        return out


# A rule: a postrl key (the value as is), a function value -> {postrl key: value} (or None: not
# mapped, with the rule's note), or `drop(why)`.
Fn = Callable[[Any], "dict[str, Any] | None"]


@dataclass(frozen=True)
class Rule:
    to: str | Fn | None
    note: str = ""


def to(key: str, note: str = "") -> Rule:
    return Rule(key, note)


def via(fn: Fn, note: str = "") -> Rule:
    return Rule(fn, note)


def drop(instead: str) -> Rule:
    return Rule(None, instead)


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def _if_true(key: str, value: Any) -> Fn:
    return lambda v: {key: value} if _bool(v) else {}


def _negate(key: str) -> Fn:
    return lambda v: {key: not _bool(v)}


def _engine(v: Any) -> dict | None:
    return {"rollout.engine": {"vllm": "vllm", "hf": "hf"}[v]} if v in ("vllm", "hf") else None


def _strategy(v: Any) -> dict | None:
    return {"train.strategy": "fsdp2"} if v in ("fsdp", "fsdp2") else None


def _schedule(v: Any) -> dict | None:
    return {"train.lr_schedule": v} if v in ("constant", "cosine") else None


KL_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def _kl(v: Any) -> dict | None:
    return {"algorithm.kl.estimator": KL_TYPES[v]} if v in KL_TYPES else None


def _adv(v: Any) -> dict | None:
    names = {"grpo": "grpo", "group_norm": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_plus_plus",
             "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "drgrpo": "drgrpo", "gae": "gae"}  # fmt: skip
    return {"algorithm.adv_estimator": names[v]} if v in names else None


def _save_freq(v: Any) -> dict:
    return {"checkpoint.save_freq": int(v)} if int(v) >= 0 else {"checkpoint.save_freq": -1}


def _test_freq(v: Any) -> dict:
    return {"eval.freq": max(int(v), 0)}


def _sinks(v: Any) -> dict:
    known = ("console", "tensorboard", "wandb", "swanlab")
    return {"logging.sinks": ["console", "jsonl"] + [s for s in _as_list(v) if s in known and s != "console"]}


def _resume_mode(v: Any) -> dict | None:
    return {"checkpoint.resume": {"auto": "auto", "disable": "none"}[v]} if v in ("auto", "disable") else None


# Verifier names of the guides -> postrl's (MindSpeed-RL's rule verifiers; verl's reward managers).
VERIFIERS = {
    "math_17k_acc": "math_17k_acc", "acc_for_dapo": "acc_for_dapo", "base_acc": "base_acc", "format": "format",
    "strict_format": "strict_format", "math_verify_reward": "math_verify", "math_verify": "math_verify",
    "gsm8k": "gsm8k", "geo3k": "geo3k",
}  # fmt: skip


def _filter_metric(v: Any) -> dict:
    # A verifier name (MindSpeed) or verl's acc / score: the accuracy of the first accuracy verifier has
    # the same zero-spread groups as acc_for_dapo's +1/-1 score or math_17k_acc's 1/0.
    return {"algorithm.filter_groups.metric": "acc" if v in VERIFIERS or v in ("acc", "score", "seq_reward", "seq_final_reward") else v}


# ------------------------------------------------------------------------------------------------ verl
# verl's ppo_trainer.yaml and the DAPO recipe's overrides. Keys not listed fall under a prefix rule
# below, or are reported as unknown.
VERL: dict[str, Rule] = {
    "data.train_files": via(lambda v: {"data.train_files": _as_list(v)}),
    "data.val_files": via(lambda v: {"data.val_files": _as_list(v)}),
    "data.prompt_key": to("data.prompt_key"),
    "data.image_key": to("data.image_key"),
    "data.max_prompt_length": to("data.max_prompt_length"),
    "data.max_response_length": to("rollout.max_tokens"),
    "data.train_batch_size": to("train.global_batch_size", "prompts per step (after filtering, as verl's DAPO)"),
    "data.gen_batch_size": to("train.gen_batch_size"),
    "data.filter_overlong_prompts": to("data.filter_overlong_prompts"),
    "data.shuffle": to("data.shuffle"),
    "data.seed": to("data.seed"),
    "data.truncation": drop("postrl never truncates a prompt: longer ones are dropped (data.filter_overlong_prompts) or refused"),
    "data.return_raw_chat": drop("postrl always keeps the chat messages and renders them with the tokenizer's template"),
    "data.filter_overlong_prompts_workers": drop("prompt filtering is a single pass at start"),
    "actor_rollout_ref.hybrid_engine": drop(PLACEMENT),
    "actor_rollout_ref.model.path": to("model.path"),
    "actor_rollout_ref.model.trust_remote_code": to("model.trust_remote_code"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": to("model.gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": to("train.use_remove_padding"),
    "actor_rollout_ref.model.lora_rank": to("model.lora_rank"),
    "actor_rollout_ref.model.lora_alpha": to("model.lora_alpha"),
    "actor_rollout_ref.model.target_modules": to("model.target_modules"),
    "actor_rollout_ref.model.use_fused_kernels": drop(FUSED),
    "actor_rollout_ref.model.enable_activation_offload": drop("activation offload: use model.gradient_checkpointing"),
    "actor_rollout_ref.actor.strategy": via(_strategy, "megatron has no postrl counterpart: " + PARALLEL),
    "actor_rollout_ref.actor.ppo_mini_batch_size": to("train.mini_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": to("train.micro_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": drop("verl's deprecated global micro batch: set ppo_micro_batch_size_per_gpu (train.micro_batch_size)"),
    "actor_rollout_ref.actor.use_dynamic_bsz": to("train.use_dynamic_bsz"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": to("train.max_token_len_per_device"),
    "actor_rollout_ref.actor.ppo_epochs": to("train.epochs_per_batch"),
    "actor_rollout_ref.actor.shuffle": drop("mini-batches keep the batch's order"),
    "actor_rollout_ref.actor.clip_ratio": via(lambda v: {"algorithm.clip_ratio_low": v, "algorithm.clip_ratio_high": v}, "both sides, unless clip_ratio_low / clip_ratio_high are given"),
    "actor_rollout_ref.actor.clip_ratio_low": to("algorithm.clip_ratio_low"),
    "actor_rollout_ref.actor.clip_ratio_high": to("algorithm.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_c": to("algorithm.clip_ratio_c"),
    "actor_rollout_ref.actor.loss_agg_mode": to("algorithm.loss_agg_mode"),
    "actor_rollout_ref.actor.entropy_coeff": to("algorithm.entropy_coef"),
    "actor_rollout_ref.actor.use_kl_loss": via(lambda v: {} if _bool(v) else {"algorithm.kl.coef": 0.0}, "false: no KL (coef 0); true: kl_loss_coef (verl's default 0.001)"),
    "actor_rollout_ref.actor.kl_loss_coef": to("algorithm.kl.coef"),
    "actor_rollout_ref.actor.kl_loss_type": via(_kl),
    "actor_rollout_ref.actor.policy_loss.loss_mode": via(lambda v: {"algorithm.policy_loss": v} if v in ("vanilla", "gspo", "cispo") else None, "postrl's policy losses: vanilla, gspo, cispo"),
    "actor_rollout_ref.actor.grad_clip": to("train.grad_clip"),
    "actor_rollout_ref.actor.optim.lr": to("train.lr"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": via(lambda v: {"train.warmup_steps": int(v)} if int(v) >= 0 else {}, "-1: lr_warmup_steps_ratio decides"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": drop("a share of the total steps: converted to train.warmup_steps when trainer.total_training_steps is given"),
    "actor_rollout_ref.actor.optim.weight_decay": to("train.weight_decay"),
    "actor_rollout_ref.actor.optim.betas": via(lambda v: {"train.betas": list(v)}),
    "actor_rollout_ref.actor.optim.warmup_style": via(_schedule, "postrl's schedules: constant, cosine"),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": via(_schedule, "postrl's schedules: constant, cosine"),
    "actor_rollout_ref.actor.optim.min_lr_ratio": to("train.min_lr_ratio"),
    "actor_rollout_ref.actor.optim.total_training_steps": drop("train.total_steps"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": drop("sequence parallelism: postrl bounds memory with train.use_dynamic_bsz, train.logprob_chunk_tokens and model.gradient_checkpointing instead"),
    "actor_rollout_ref.actor.use_torch_compile": drop("postrl runs the model eagerly for training"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": drop("parameter offload of the actor: postrl keeps the policy on the device (train.ref_offload offloads the reference; vLLM sleeps during the update)"),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": drop("optimizer offload: AdamW state stays on the device, sharded by FSDP2"),
    "actor_rollout_ref.actor.fsdp_config.offload_policy": drop("CPU offload policy: not supported for the actor"),
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": drop("FSDP2 shards over the whole world (no hybrid-shard group size)"),
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": drop("FSDP2 prefetches by default"),
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": to("train.reshard_after_forward"),
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params": drop(WRAP),
    "actor_rollout_ref.ref.fsdp_config.reshard_after_forward": drop("the reference runs forward only: its blocks are always freed after their forward"),
    "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params": drop(WRAP),
    "actor_rollout_ref.rollout.name": via(_engine, "postrl's engines: vllm, hf"),
    "actor_rollout_ref.rollout.mode": drop("postrl's rollout is synchronous and colocated"),
    "actor_rollout_ref.rollout.n": to("rollout.n_samples_per_prompt"),
    "actor_rollout_ref.rollout.temperature": to("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": to("rollout.top_p"),
    "actor_rollout_ref.rollout.top_k": to("rollout.top_k"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": to("rollout.gpu_memory_utilization"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": to("rollout.tensor_parallel_size"),
    "actor_rollout_ref.rollout.max_num_seqs": to("rollout.max_num_seqs"),
    "actor_rollout_ref.rollout.enforce_eager": to("rollout.enforce_eager"),
    "actor_rollout_ref.rollout.free_cache_engine": to("rollout.enable_sleep_mode"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": drop("vLLM's default (on) is kept"),
    "actor_rollout_ref.rollout.max_model_len": drop("derived: data.max_prompt_length + rollout.max_tokens"),
    "actor_rollout_ref.rollout.response_length": to("rollout.max_tokens"),
    "actor_rollout_ref.rollout.prompt_length": to("data.max_prompt_length"),
    "actor_rollout_ref.rollout.dtype": drop("the engine holds model.dtype weights"),
    "actor_rollout_ref.rollout.load_format": drop("postrl loads the engine from model.path and syncs weights in memory"),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": drop("follows train.use_dynamic_bsz"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": to("train.log_prob_micro_batch_size"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": to("train.log_prob_micro_batch_size"),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": to("train.log_prob_max_token_len"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": to("train.log_prob_max_token_len"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": drop("verl's deprecated global size: set log_prob_micro_batch_size_per_gpu (train.log_prob_micro_batch_size)"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": drop("verl's deprecated global size: set log_prob_micro_batch_size_per_gpu (train.log_prob_micro_batch_size)"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": to("rollout.max_num_batched_tokens"),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": drop("follows train.use_dynamic_bsz"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": to("eval.temperature"),
    "actor_rollout_ref.rollout.val_kwargs.n": to("eval.n_samples"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": via(lambda v: {} if _bool(v) else {"eval.temperature": 0.0}, "false: greedy (temperature 0)"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": drop("validation samples with rollout.top_p"),
    "actor_rollout_ref.rollout.val_kwargs.top_k": drop("validation samples with rollout.top_k"),
    "actor_rollout_ref.ref.fsdp_config.param_offload": to("train.ref_offload"),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": drop("sequence parallelism: see actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    "algorithm.adv_estimator": via(_adv, "an estimator postrl does not have"),
    "algorithm.norm_adv_by_std_in_grpo": to("algorithm.norm_adv_by_std"),
    "algorithm.use_kl_in_reward": to("algorithm.use_kl_in_reward", "PPO (gae) only in postrl"),
    "algorithm.kl_penalty": via(_kl, "the estimator of the KL in the reward and of the KL loss"),
    "algorithm.kl_ctrl.kl_coef": to("algorithm.kl_ctrl.kl_coef"),
    "algorithm.kl_ctrl.type": via(lambda v: {} if v == "fixed" else None, "postrl's KL-in-reward coefficient is fixed"),
    "algorithm.gamma": to("algorithm.gamma"),
    "algorithm.lam": to("algorithm.lam"),
    "algorithm.filter_groups.enable": to("algorithm.filter_groups.enable"),
    "algorithm.filter_groups.metric": via(_filter_metric),
    "algorithm.filter_groups.max_num_gen_batches": to("algorithm.filter_groups.max_num_gen_batches"),
    "reward_model.enable": via(lambda v: {} if not _bool(v) else None, "a model-based reward: postrl scores with rule verifiers (reward.verifiers)"),
    "reward_model.reward_manager": via(lambda v: {"reward.verifiers": [{"name": "acc_for_dapo", "weight": 1.0}]} if v == "dapo" else None,
                                       "dapo: DAPO's +1/-1 'Answer:' rule (acc_for_dapo); verl's naive manager picks a score function by data_source, postrl names it in reward.verifiers"),
    "reward_model.overlong_buffer.enable": to("algorithm.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": to("algorithm.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": to("algorithm.overlong_buffer.penalty_factor"),
    "reward_model.overlong_buffer.log": drop("the overlong penalty is in <algo>/rewards vs <algo>/score"),
    "custom_reward_function.path": drop("a file path: postrl names a user verifier as package.module:function in reward.verifiers"),
    "custom_reward_function.name": drop("see custom_reward_function.path"),
    "trainer.total_epochs": to("train.total_epochs"),
    "trainer.total_training_steps": to("train.total_steps"),
    "trainer.save_freq": via(_save_freq, "-1: never save"),
    "trainer.test_freq": via(_test_freq, "-1: only before / after training"),
    "trainer.val_before_train": to("eval.before_train"),
    "trainer.logger": via(_sinks),
    "trainer.project_name": drop("the W&B / SwanLab project is 'postrl'; name the run with trainer.experiment_name (logging.dir)"),
    "trainer.experiment_name": via(lambda v: {"logging.dir": f"runs/{v}"}),
    "trainer.default_local_dir": to("checkpoint.dir"),
    "trainer.nnodes": to("cluster.nnodes"),
    "trainer.n_gpus_per_node": to("cluster.devices_per_node"),
    "trainer.device": via(lambda v: {"train.device": v} if v in ("cpu", "cuda", "npu", "auto") else None),
    "trainer.resume_mode": via(_resume_mode, "resume_path: set trainer.resume_from_path"),
    "trainer.resume_from_path": via(lambda v: {"checkpoint.resume": str(v)} if v else {}),
    "trainer.max_actor_ckpt_to_keep": via(lambda v: {"checkpoint.keep_last": int(v) if v else 0}),
    "trainer.critic_warmup": drop(GAE),
    "trainer.balance_batch": drop("postrl balances every update's rows across ranks by tokens (partition.py) always"),
    "trainer.log_val_generations": drop(LOGGING),
    "trainer.val_only": drop("use `postrl eval CONFIG`"),
    "trainer.del_local_ckpt_after_load": drop("checkpoints are kept per checkpoint.keep_last"),
    "trainer.ray_wait_register_center_timeout": drop(PLACEMENT),
}  # fmt: skip

VERL_PREFIXES: dict[str, str] = {
    "critic.": GAE,
    "actor_rollout_ref.actor.checkpoint.": "checkpoint contents are fixed (HF model, optimizer, scheduler, RNG): checkpoint.load_optimizer / load_rng choose what a resume restores",
    "actor_rollout_ref.actor.profiler.": LOGGING,
    "actor_rollout_ref.rollout.engine_kwargs.": "engine-specific arguments: postrl's rollout section names the vLLM settings it passes",
    "actor_rollout_ref.rollout.multi_turn.": "multi-turn agent rollouts are not in this postrl version",
    "actor_rollout_ref.rollout.agent.": "multi-turn agent rollouts are not in this postrl version",
    "algorithm.kl_ctrl.": "the adaptive KL controller: postrl's KL-in-reward coefficient is fixed (algorithm.kl_ctrl.kl_coef)",
    "reward_model.model.": "a model-based reward: postrl scores with rule verifiers (reward.verifiers)",
    "ray_init.": PLACEMENT,
    "ray_kwargs.": PLACEMENT,
}

# The heads of override keys that only verl uses: an override under one of them goes through VERL.
VERL_HEADS = ("actor_rollout_ref.", "trainer.", "reward_model.", "critic.", "custom_reward_function.", "ray_init.", "ray_kwargs.")


# ---------------------------------------------------------------------------------------- MindSpeed-RL
# The sections of a MindSpeed-RL YAML (megatron_training, actor_config, rl_config, generate_config)
# are flattened; a key means the same in any of them, so the table names it once.
MINDSPEED: dict[str, Rule] = {
    "model": drop("the Megatron model name: postrl loads the Hugging Face model at model.path (megatron_training.tokenizer_name_or_path)"),
    "tokenizer_name_or_path": to("model.path", "the Hugging Face directory: postrl loads weights and tokenizer from it"),
    "tokenizer_type": drop("postrl always uses the model's Hugging Face tokenizer"),
    "tokenizer_not_use_fast": drop("postrl uses the tokenizer AutoTokenizer picks"),
    "global_batch_size": to("train.global_batch_size", "prompts per step; the generation batch when filter_groups_train_batch_size is set"),
    "seq_length": drop("derived: data.max_prompt_length + rollout.max_tokens"),
    "save_interval": to("checkpoint.save_freq"),
    "train_iters": to("train.total_steps"),
    "stage": via(lambda v: {"algorithm.name": "dapo" if "dapo" in str(v) else "grpo"} if str(v) in ("ray_grpo", "ray_dapo") else None, "postrl trains grpo / dapo"),
    "data_path": drop(DATA),
    "split": drop("postrl reads separate train and validation files (data.train_files, data.val_files)"),
    "no_shuffle": via(_negate("data.shuffle")),
    "full_shuffle_instruction_dataset": drop("data.shuffle reshuffles the prompts every epoch"),
    "seed": to("train.seed"),
    "bf16": via(_if_true("model.dtype", "bfloat16")),
    "fp16": via(_if_true("model.dtype", "float16")),
    "dtype": via(lambda v: {"model.dtype": v} if v in ("bfloat16", "float16", "float32") else None),
    "use_flash_attn": via(lambda v: {}, "model.attn_implementation: auto picks flash attention on GPUs where it is installed"),
    "distributed_backend": drop("postrl picks the backend per device: nccl (cuda), hccl (npu), gloo (cpu)"),
    "no_shared_storage": drop("postrl needs checkpoint.dir on storage every node sees (each node keeping its own ranks' files is not offered); a multi-node run whose nodes do not share it stops at start with the fix (storage.py)"),
    "dataset_additional_keys": drop("postrl reads the ground truth from data.answer_key (reward_model.ground_truth of the verl schema)"),
    "micro_batch_size": to("train.micro_batch_size"),
    "lr": to("train.lr"),
    "lr_decay_style": via(_schedule, "postrl's schedules: constant, cosine"),
    "min_lr": drop("converted to train.min_lr_ratio = min_lr / lr"),
    "lr_warmup_fraction": drop("converted to train.warmup_steps = fraction x train_iters"),
    "weight_decay": to("train.weight_decay"),
    "clip_grad": to("train.grad_clip"),
    "adam_beta1": drop("converted to train.betas"),
    "adam_beta2": drop("converted to train.betas"),
    "finetune": to("checkpoint.finetune"),
    "load": drop("a Megatron checkpoint (converted weights): postrl starts from the Hugging Face weights at model.path and resumes from checkpoint.dir"),
    "save": to("checkpoint.dir"),
    "no_load_optim": via(_negate("checkpoint.load_optimizer")),
    "no_load_rng": via(_negate("checkpoint.load_rng")),
    "no_save_optim": drop("checkpoints always hold the optimizer (resume needs it)"),
    "no_save_rng": drop("checkpoints always hold the RNG states"),
    "guarantee_order": drop(PLACEMENT),
    "use_integrated_worker": drop(PLACEMENT),
    "blocking": drop(PLACEMENT),
    "num_cpus_for_local_task": drop(PLACEMENT),
    "zmq_communication": drop(PLACEMENT),
    "gamma": drop(GAE),
    "lam": drop(GAE),
    "cliprange_value": drop(GAE),
    "actor_forward_micro_batch_size": to("train.log_prob_micro_batch_size"),
    "ref_forward_micro_batch_size": to("train.log_prob_micro_batch_size"),
    "adv_estimator": via(_adv, "postrl's estimators: grpo (= group_norm), drgrpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline"),
    "kl_penalty": via(_kl),
    "kl_ctrl_type": via(lambda v: {} if v == "fixed" else None, "postrl's KL coefficient is fixed"),
    "init_kl_coef": to("algorithm.kl.coef"),
    "use_kl_in_reward": via(lambda v: {} if not _bool(v) else None, "KL in the reward: postrl applies KL as a loss (algorithm.kl.coef)"),
    "mini_batch_size": to("train.mini_batch_size"),
    "max_prompt_length": to("data.max_prompt_length"),
    "epochs": to("train.epochs_per_batch"),
    "clip_ratio": via(lambda v: {"algorithm.clip_ratio_low": v, "algorithm.clip_ratio_high": v}, "both sides, unless clip_higher_enable"),
    "entropy_coeff": to("algorithm.entropy_coef"),
    "shuffle_mini_batch": drop("mini-batches keep the batch's order"),
    "n_samples_per_prompt": to("rollout.n_samples_per_prompt"),
    "rule_reward": via(lambda v: {} if _bool(v) else None, "postrl's reward is its rule verifiers (reward.verifiers)"),
    "verifier_function": drop("converted with verifier_weight to reward.verifiers"),
    "verifier_weight": drop("converted with verifier_function to reward.verifiers"),
    "verifier_parallel": to("reward.workers"),
    "verifier_timeout": to("reward.timeout_s"),
    "log_max_throughput": drop(LOGGING),
    "use_tensorboard": via(lambda v: {}, "converted to logging.sinks"),
    "use_wandb": via(lambda v: {}, "converted to logging.sinks"),
    "token_level_loss": via(lambda v: {"algorithm.loss_agg_mode": "token-mean" if _bool(v) else "seq-mean-token-mean"}),
    "clip_higher_enable": via(lambda v: {}, "true: clip_ratio_low / clip_ratio_high; false: clip_ratio both sides"),
    "clip_ratio_low": via(lambda v: {}, "used when clip_higher_enable (algorithm.clip_ratio_low)"),
    "clip_ratio_high": via(lambda v: {}, "used when clip_higher_enable (algorithm.clip_ratio_high)"),
    "overlong_buffer_enable": to("algorithm.overlong_buffer.enable"),
    "overlong_buffer": to("algorithm.overlong_buffer.len"),
    "overlong_buffer_penalty_factor": to("algorithm.overlong_buffer.penalty_factor"),
    "rollout_max_tokens": to("rollout.max_tokens"),
    "filter_groups_enable": to("algorithm.filter_groups.enable"),
    "filter_groups_metric": via(_filter_metric),
    "filter_groups_max_batches": to("algorithm.filter_groups.max_num_gen_batches"),
    "filter_groups_train_batch_size": drop("converted: train.global_batch_size (groups trained per step), with global_batch_size as train.gen_batch_size"),
    "use_dynamic_bsz": to("train.use_dynamic_bsz"),
    "max_packing_token_size": to("train.max_token_len_per_device"),
    "update_max_packing_token_size": to("train.max_token_len_per_device"),
    "actor_max_packing_token_size": to("train.log_prob_max_token_len"),
    "ref_max_packing_token_size": to("train.log_prob_max_token_len"),
    "use_remove_padding": to("train.use_remove_padding"),
    "use_dp_batch_balance": drop("postrl balances every update's rows across ranks by tokens (partition.py) always"),
    "reward_dispatch_size": drop(PLACEMENT),
    "adv_dispatch_size": drop(PLACEMENT),
    "actor_update_dispatch_size": drop(PLACEMENT),
    "trust_remote_code": to("model.trust_remote_code"),
    "offload_train_optimizer": drop("the optimizer stays on the device (sharded by FSDP2); vLLM sleeps during the update (rollout.enable_sleep_mode)"),
    "offload_train_grad": drop("gradients are freed before rollout (the actor frees them each step)"),
    "offload_train_param": drop("the policy stays on the device; vLLM releases its weights and KV cache during the update (rollout.enable_sleep_mode)"),
    "infer_tensor_parallel_size": to("rollout.tensor_parallel_size"),
    "infer_pipeline_parallel_size": drop(PARALLEL),
    "infer_expert_parallel_size": drop(PARALLEL),
    "max_num_seqs": to("rollout.max_num_seqs"),
    "max_model_len": drop("derived: data.max_prompt_length + rollout.max_tokens"),
    "max_num_batched_tokens": to("rollout.max_num_batched_tokens"),
    "gpu_memory_utilization": to("rollout.gpu_memory_utilization"),
    "enforce_eager": to("rollout.enforce_eager"),
    "enable_prefix_caching": drop("vLLM's default is kept"),
    "torchair_graph": drop(ASCEND),
    "ascend_scheduler_config_enabled": drop(ASCEND),
    "hccl_buffersize": drop(ASCEND),
    "sampling_config.max_tokens": to("rollout.max_tokens"),
    "sampling_config.temperature": to("rollout.temperature"),
    "sampling_config.top_p": to("rollout.top_p"),
    "sampling_config.top_k": to("rollout.top_k"),
    "sampling_config.min_p": via(lambda v: {} if float(v) == 0 else None, "min_p sampling is not offered (0 = off is the default)"),
    "sampling_config.logprobs": drop("the engine always returns the sampled tokens' log-probs"),
    "sampling_config.detokenize": drop("the engine returns token ids; text is decoded once for the verifiers"),
    "sampling_config.seed": drop("sampling is seeded from train.seed"),
    "lora_r": to("model.lora_rank"),
    "lora_alpha": to("model.lora_alpha"),
    "lora_target_modules": to("model.target_modules"),
    "recompute_granularity": via(lambda v: {"model.gradient_checkpointing": True} if v == "full" else None, "full: model.gradient_checkpointing"),
    "recompute_method": drop("model.gradient_checkpointing recomputes every layer"),
    "recompute_num_layers": drop("model.gradient_checkpointing recomputes every layer"),
    "log_interval": to("logging.log_interval"),
    "eval_interval": to("eval.freq"),
    "eval_iters": drop("eval.max_prompts bounds a validation"),
}  # fmt: skip

_MEGATRON_SWITCHES = (
    "use_mcore_models sequence_parallel use_distributed_optimizer reuse_fp32_param attention_dropout hidden_dropout "
    "init_method_std no_pad_to_seq_lengths reset_attention_mask attention_mask_type initial_loss_scale "
    "overlap_grad_reduce swap_optimizer swap_attention gemm_gradient_accumulation_fusion shape_order noop_layers "
    "num_layer_list refer_model_iter moe_tp_extend_ep moe_alltoall_overlap_comm moe_permutation_async_comm "
    "moe_grouped_gemm moe_token_dispatcher_type use_fused_moe_token_permute_and_unpermute spec"
)
_FUSED_SWITCHES = (
    "use_fused_rmsnorm use_fused_swiglu use_fused_rotary_pos_emb no_masked_softmax_fusion attention_softmax_in_fp32 "
    "no_gradient_accumulation_fusion lora_fusion"
)
_PARALLEL_SIZES = (
    "tensor_model_parallel_size pipeline_model_parallel_size context_parallel_size context_parallel_algo "
    "expert_model_parallel_size enable_expert_parallel num_layers_per_virtual_pipeline_stage"
)
_ARCH_KEYS = (
    "num_layers hidden_size ffn_hidden_size num_attention_heads num_query_groups group_query_attention "
    "max_position_embeddings make_vocab_size_divisible_by padded_vocab_size untie_embeddings_and_output_weights "
    "swiglu rotary_base position_embedding_type normalization norm_epsilon disable_bias_linear add_qkv_bias "
    "qk_layernorm kv_channels use_rotary_position_embeddings num_experts moe_router_topk moe_ffn_hidden_size "
    "moe_router_load_balancing_type moe_aux_loss_coeff norm_topk_prob seq_aux first_k_dense_replace n_shared_experts "
    "rope_scaling_type rope_scaling_factor"
)
for _keys, _why in ((_MEGATRON_SWITCHES, MEGATRON), (_FUSED_SWITCHES, FUSED), (_PARALLEL_SIZES, PARALLEL), (_ARCH_KEYS, ARCH)):
    for _k in _keys.split():
        MINDSPEED.setdefault(_k, drop(_why))

MINDSPEED_PREFIXES: dict[str, str] = {
    "defaults": "the model's architecture file: postrl reads config.json at model.path",
    "actor_resource.": PLACEMENT,
    "reference_resource.": PLACEMENT,
    "reward_resource.": PLACEMENT,
    "critic_resource.": GAE,
    "critic_config.": GAE,
    "ref_config.": "the reference model is a frozen copy of the policy (checkpoint.ref_model_path names other weights)",
    "reward_config.": "a model-based reward: postrl scores with rule verifiers (reward.verifiers)",
}
MINDSPEED_SECTIONS = ("megatron_training", "actor_config", "rl_config", "generate_config")


# ------------------------------------------------------------------------------------------- engine
def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _apply(conv: Conversion, table: dict[str, Rule], prefixes: dict[str, str], key: str, value: Any, source: str | None = None) -> None:
    source = source or key
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string; the guides write it so
    rule = table.get(key)
    if rule is None:
        why = next((w for p, w in prefixes.items() if key == p.rstrip(".") or key.startswith(p)), None)
        conv.unmapped.append(Unmapped(source, value, why or f"not in postrl's table of {conv.dialect} keys (docs/guides.md); nothing was set"))
        return
    if rule.to is None:
        conv.unmapped.append(Unmapped(source, value, rule.note))
        return
    try:
        targets = {rule.to: value} if isinstance(rule.to, str) else rule.to(value)
    except (KeyError, TypeError, ValueError):
        targets = None
    if targets is None:
        conv.unmapped.append(Unmapped(source, value, f"the value {value!r} has no postrl counterpart: {rule.note}"))
    else:
        conv.mapped.append(Mapped(source, value, targets, rule.note))


def _build_tree(conv: Conversion) -> None:
    conv.tree = {}
    for key, value in conv.flat().items():
        node = conv.tree
        *parents, leaf = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value


def _parse(items: list[str]) -> list[tuple[str, Any]]:
    """`key=value` pairs, values read as YAML (so True is a bool, 0.28 a float, [a,b] a list)."""
    pairs, bad = [], []
    for item in items:
        key, sep, raw = item.lstrip("+").partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            bad.append(f"'{item}' is not of the form key=value. Fix: write it like actor_rollout_ref.rollout.n=8.")
            continue
        try:
            pairs.append((key, yaml.safe_load(raw) if raw != "" else ""))
        except yaml.YAMLError:
            pairs.append((key, raw))
    if bad:
        raise UserError(*bad, title="bad verl overrides")
    return pairs


def _unmapped_to_mapped(conv: Conversion, source: str, targets: dict, note: str) -> None:
    """A key listed as unmapped whose meaning a combination gave after all."""
    for i, u in enumerate(conv.unmapped):
        if u.source == source:
            del conv.unmapped[i]
            conv.mapped.append(Mapped(source, u.value, targets, note))
            return


def convert_verl(overrides: list[str] | dict[str, Any]) -> Conversion:
    """A verl override list (`key=value` items, Hydra's `+` / `++` prefixes allowed) in postrl's names."""
    pairs = list(overrides.items()) if isinstance(overrides, dict) else _parse(overrides)
    conv = Conversion("verl")
    given = dict(pairs)
    for key, value in pairs:
        _apply(conv, VERL, VERL_PREFIXES, key, value)
    flat = conv.flat()
    # verl's clip_ratio fills only the sides that are not given; use_kl_loss=true keeps verl's default coefficient.
    for m in conv.mapped:
        if m.source == "actor_rollout_ref.actor.clip_ratio":
            m.targets = {k: v for k, v in m.targets.items() if k.rsplit(".", 1)[1] not in {s.rsplit(".", 1)[1] for s in given}}
        if m.source == "actor_rollout_ref.actor.use_kl_loss" and _bool(m.value) and "actor_rollout_ref.actor.kl_loss_coef" not in given:
            m.targets = {"algorithm.kl.coef": 0.001}
        if m.source == "actor_rollout_ref.actor.kl_loss_coef" and "actor_rollout_ref.actor.use_kl_loss" in given and not _bool(given["actor_rollout_ref.actor.use_kl_loss"]):
            m.targets = {}
            m.note = "ignored: use_kl_loss is false"
    if "trainer.total_training_steps" in given:  # verl: total_training_steps wins over total_epochs
        for m in conv.mapped:
            if m.source == "trainer.total_epochs":
                m.targets, m.note = {}, "ignored: trainer.total_training_steps is given and wins, as in verl"
    ratio = given.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio")
    if ratio is not None and "train.total_steps" in flat and int(given.get("actor_rollout_ref.actor.optim.lr_warmup_steps", -1)) < 0:
        _unmapped_to_mapped(conv, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
                            {"train.warmup_steps": int(float(ratio) * int(flat["train.total_steps"]))}, "ratio x trainer.total_training_steps")  # fmt: skip
    _build_tree(conv)
    return conv


def convert_mindspeed(tree: dict) -> Conversion:
    """A MindSpeed-RL YAML (its four sections, or the flat keys) in postrl's names."""
    conv = Conversion("MindSpeed-RL")
    items: list[tuple[str, str, Any]] = []  # (key, source path, value); a key may stand in two sections
    for top, value in tree.items():
        if top in MINDSPEED_SECTIONS and isinstance(value, dict):
            items += [(k, f"{top}.{k}", v) for k, v in _flatten(value).items()]
        else:
            items += [(k, k, v) for k, v in (_flatten({top: value}) if isinstance(value, dict) else {top: value}).items()]
    for key, source, value in items:
        _apply(conv, MINDSPEED, MINDSPEED_PREFIXES, key, value, source)
    got = {k: v for k, _, v in items}
    src = {k: s for k, s, _ in items}

    def combine(key: str, targets: dict, note: str) -> None:
        _unmapped_to_mapped(conv, src[key], targets, note)

    if _bool(got.get("clip_higher_enable", False)):
        clip = {f"algorithm.{k}": got[k] for k in ("clip_ratio_low", "clip_ratio_high") if k in got}
        for m in conv.mapped:  # clip_higher's two sides win over clip_ratio
            if m.source == src.get("clip_ratio"):
                m.targets = {k: v for k, v in m.targets.items() if k not in clip}
            if m.source in (src.get("clip_ratio_low"), src.get("clip_ratio_high")):
                m.targets = {f"algorithm.{m.source.rsplit('.', 1)[1]}": m.value}
    if "filter_groups_train_batch_size" in got and _bool(got.get("filter_groups_enable", False)):
        combine("filter_groups_train_batch_size", {"train.global_batch_size": int(got["filter_groups_train_batch_size"])},
                "groups trained per step; the generation batch is global_batch_size (train.gen_batch_size)")  # fmt: skip
        for m in conv.mapped:
            if m.source == src.get("global_batch_size"):
                m.targets = {"train.gen_batch_size": m.value}
                m.note = "prompts per generation batch (dynamic sampling keeps filter_groups_train_batch_size of them)"
    if "min_lr" in got and got.get("lr"):
        combine("min_lr", {"train.min_lr_ratio": float(got["min_lr"]) / float(got["lr"])}, "min_lr / lr")
    if "lr_warmup_fraction" in got and "train_iters" in got:
        combine("lr_warmup_fraction", {"train.warmup_steps": int(math.floor(float(got["lr_warmup_fraction"]) * int(got["train_iters"])))}, "fraction x train_iters")  # fmt: skip
    if "adam_beta1" in got or "adam_beta2" in got:
        betas = [float(got.get("adam_beta1", 0.9)), float(got.get("adam_beta2", 0.999))]
        for k in ("adam_beta1", "adam_beta2"):
            if k in got:
                combine(k, {"train.betas": betas}, "train.betas")
    names = got.get("verifier_function")
    if names is not None:
        weights = _as_list(got.get("verifier_weight", [1.0] * len(_as_list(names))))
        known = [(VERIFIERS[n], float(w)) for n, w in zip(_as_list(names), weights) if n in VERIFIERS]
        unknown = [n for n in _as_list(names) if n not in VERIFIERS]
        if known:
            combine("verifier_function", {"reward.verifiers": [{"name": n, "weight": w} for n, w in known]}, "with verifier_weight")
            if "verifier_weight" in got:
                combine("verifier_weight", {}, "in reward.verifiers")
        for n in unknown:
            conv.unmapped.append(Unmapped(f"{src['verifier_function']}[{n}]", n, f"no postrl verifier of that name; registered: {', '.join(sorted(set(VERIFIERS.values())))}, or your own package.module:function"))
    sinks = ["console", "jsonl"] + [s for s, k in (("tensorboard", "use_tensorboard"), ("wandb", "use_wandb")) if _bool(got.get(k, False))]
    for m in conv.mapped:
        if m.source in (src.get("use_tensorboard"), src.get("use_wandb")):
            m.targets = {"logging.sinks": sinks}
    _build_tree(conv)
    return conv


def read_verl_overrides(text: str) -> list[str]:
    """The `key=value` items of a verl command line or override file (one or more a line; `\\`, comments,
    `python3 -m verl.trainer.main_ppo` and shell variables' quotes tolerated)."""
    import shlex

    items = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for tok in shlex.split(line, posix=True):
            if "=" in tok and not tok.startswith("-"):
                key = tok.split("=", 1)[0].lstrip("+")
                if "." in key or key in ("data", "trainer"):
                    items.append(tok)
    return items


def convert_file(path: str | Path) -> Conversion:
    """Detect the dialect of a file: a YAML mapping with MindSpeed-RL's sections, else a verl override list."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"'{path}' does not exist. Fix: pass a MindSpeed-RL YAML or a file of verl overrides (key=value).")
    text = p.read_text()
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        tree = None
    if isinstance(tree, dict) and (set(tree) & set(MINDSPEED_SECTIONS) or "rl_config" in tree):
        return convert_mindspeed(tree)
    items = read_verl_overrides(text)
    if not items:
        raise UserError(
            f"{path} is neither a MindSpeed-RL YAML (megatron_training / actor_config / rl_config / generate_config "
            "sections) nor a list of verl overrides (key=value). Fix: pass one of those."
        )
    return convert_verl(items)


def split_overrides(overrides: list[str], is_postrl_key: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """(verl-style overrides, postrl overrides) of a command line: a key under a verl-only head, or a
    key the verl table names that is not a postrl key (data.train_batch_size, algorithm.use_kl_in_reward)."""
    verl, native = [], []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+")
        known = key in VERL or key.startswith(tuple(VERL_PREFIXES))
        is_verl = (key.startswith(VERL_HEADS) or known) and not is_postrl_key(key)  # postrl has a critic section too
        (verl if is_verl else native).append(item)
    return verl, native


# ------------------------------------------------------------------------------------------- output
def render_yaml(conv: Conversion, source: str) -> str:
    """The postrl YAML: one comment per mapped key (its source), then the keys not mapped with what postrl offers."""
    origin: dict[str, list[str]] = {}
    for m in conv.mapped:
        for k in m.targets:
            origin.setdefault(k, []).append(m.source + (f" ({m.note})" if m.note else ""))
    lines = [f"# postrl configuration converted from {source} ({conv.dialect}) by `postrl convert-config`.",
             "# Check it with `postrl check-config` (the keys postrl did not map are listed at the end)."]  # fmt: skip

    def emit(node: dict, path: str, indent: int) -> None:
        for k, v in node.items():
            key = f"{path}{k}"
            pad = "  " * indent
            if isinstance(v, dict) and v:
                lines.append(f"{pad}{k}:")
                emit(v, key + ".", indent + 1)
            else:
                text = yaml.safe_dump(v, default_flow_style=True, width=10_000).strip()
                text = text[:-4].rstrip() if text.endswith("\n...") else text.removesuffix("...").rstrip()
                comment = f"  # from {'; '.join(origin[key])}" if key in origin else ""
                lines.append(f"{pad}{k}: {text}{comment}")

    emit(conv.tree, "", 0)
    silent = [m for m in conv.mapped if not m.targets]
    if silent:
        lines.append("")
        lines.append(f"# Mapped with nothing to set ({len(silent)} keys): postrl's behaviour already is what they ask.")
        for m in silent:
            lines.append(f"#   {m.source} = {m.value!r}" + (f": {m.note}" if m.note else ""))
    if conv.unmapped:
        lines.append("")
        lines.append(f"# Not mapped ({len(conv.unmapped)} keys): what postrl offers instead.")
        for u in conv.unmapped:
            lines.append(f"#   {u.source} = {u.value!r}: {u.instead}")
    return "\n".join(lines) + "\n"
