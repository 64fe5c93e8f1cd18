"""verl's keys (override lists such as `actor_rollout_ref.rollout.n=16`) in postrl's names (docs/guides.md)."""

from __future__ import annotations


from postrl.guides.rules import (
    REWARD_MANAGER,
    _reward_manager,
    FUSED,
    GAE,
    LOGGING,
    PARALLEL,
    PLACEMENT,
    Rule,
    WRAP,
    _adv,
    _as_list,
    _bool,
    _engine,
    _filter_metric,
    _kl,
    _resume_mode,
    _save_freq,
    _schedule,
    _sinks,
    _strategy,
    _test_freq,
    TOOLS,
    drop,
    to,
    via,
)


SAMPLES_DIR_NOTE = "written to <logging.dir>/samples/ (rollout_step_N.jsonl, val_step_N.jsonl), not to the directory given"


def _policy_losses() -> list[str]:
    from postrl.algorithms import POLICY_LOSSES

    return sorted(POLICY_LOSSES)


_POLICY_LOSSES = _policy_losses()


def _loss_mode(v):
    """verl's loss_mode names are postrl's policy-loss names (vanilla, gspo, sapo, gpg, geo_mean, clip_cov, ...)."""
    return {"algorithm.policy_loss": v} if v in _POLICY_LOSSES else None


def _unset(v) -> bool:
    """verl's null (no dump) as a command line or YAML gives it."""
    return v is None or str(v).strip().lower() in ("", "null", "none", "~")


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
    "actor_rollout_ref.actor.policy_loss.loss_mode": via(_loss_mode, "postrl's policy losses: " + ", ".join(_POLICY_LOSSES), strict=True),
    # verl's parameters of its covariance losses, under the same names (algorithms/surrogates.py)
    **{f"actor_rollout_ref.actor.policy_loss.{k}": to(f"algorithm.policy_loss_args.{k}")
       for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
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
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": to("train.sequence_parallel_size"),
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
    "actor_rollout_ref.rollout.mode": drop("verl's sync / async choose its server-based rollout (async serves the agent loop), "
                                          "still on-policy: postrl runs the agent loop with rollout.multi_turn.enable; postrl's "
                                          "rollout.mode: async (rollout ahead of the update, off-policy up to rollout.max_staleness) "
                                          "is another thing, not set from this key"),
    "actor_rollout_ref.rollout.expert_parallel_size": to("rollout.expert_parallel_size"),
    "actor_rollout_ref.rollout.multi_turn.enable": to("rollout.multi_turn.enable"),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": to("rollout.multi_turn.max_turns"),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": to("rollout.multi_turn.max_user_turns"),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": to("rollout.multi_turn.max_parallel_calls"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": to("rollout.multi_turn.max_tool_response_tokens"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": drop(TOOLS),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": drop("postrl names the environment as package.module:Class in rollout.multi_turn.interaction (docs/agents.md)"),
    "actor_rollout_ref.ref.strategy": via(_strategy, "megatron has no postrl counterpart: " + PARALLEL),
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
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": drop("the reference's log-prob pass uses the actor's train.sequence_parallel_size (actor_rollout_ref.actor.ulysses_sequence_parallel_size)"),
    "algorithm.adv_estimator": via(_adv, "postrl's estimators: grpo, drgrpo, rloo, reinforce_plus_plus(_seq, _baseline), gae (PPO with postrl's critic section)", strict=True),
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
    "reward_model.enable": via(lambda v: {} if _bool(v) in (True, False) else None, "true: a reward model at reward_model.model.path (reward.reward_model, added to the verifiers); false: verifiers only"),
    "reward_model.model.path": to("reward.reward_model.path", "a sequence-classification RM (docs/rewards.md)"),
    "reward_model.micro_batch_size_per_gpu": to("reward.reward_model.micro_batch_size"),
    "reward_model.reward_manager": via(_reward_manager, REWARD_MANAGER, strict=True),
    "reward_model.reward_manager.name": via(_reward_manager, REWARD_MANAGER, strict=True),
    "reward_model.overlong_buffer.enable": to("algorithm.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": to("algorithm.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": to("algorithm.overlong_buffer.penalty_factor"),
    "reward_model.overlong_buffer.log": drop("the overlong penalty is in <algo>/rewards vs <algo>/score"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": to("algorithm.overlong_buffer.enable", "the DAPO manager's overlong buffer (newer verl's name)"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": to("algorithm.overlong_buffer.len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": to("algorithm.overlong_buffer.penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": drop("the overlong penalty is in <algo>/rewards vs <algo>/score"),
    "reward_model.reward_kwargs.max_resp_len": drop("the buffer counts back from rollout.max_tokens (verl's max response length, which its recipes pass here)"),
    "custom_reward_function.path": drop("with custom_reward_function.name (default compute_score): reward.verifiers [verl:<path>:<name>], the file called unchanged with verl's signature (docs/guides.md)"),
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
    "trainer.log_val_generations": to("logging.samples.print_val", "that many validation generations printed as a table per validation"),
    "trainer.rollout_data_dir": via(lambda v: {"logging.samples.rollout_freq": 0 if _unset(v) else 1}, SAMPLES_DIR_NOTE),
    "trainer.validation_data_dir": via(lambda v: {"logging.samples.val": not _unset(v)}, SAMPLES_DIR_NOTE),
    "trainer.val_only": drop("use `postrl eval CONFIG`"),
    "trainer.del_local_ckpt_after_load": drop("checkpoints are kept per checkpoint.keep_last"),
    "trainer.ray_wait_register_center_timeout": drop(PLACEMENT),
    # verl's fully_async entry point (postrl.guides.fully_async): mapped together onto rollout.placement: pool
    "rollout.nnodes": drop("with the Rollouter's n_gpus_per_node and tensor_model_parallel_size: rollout.placement pool, rollout.pool.replicas, rollout.pool.devices_per_replica (fully_async only)"),
    "rollout.n_gpus_per_node": drop("with the Rollouter's nnodes: rollout.placement pool (fully_async only)"),
    "rollout.total_rollout_steps": drop("prompts the Rollouter generates: train.total_steps = it / train.global_batch_size (fully_async only)"),
    "rollout.total_epochs": drop("passes over the prompts of verl's Rollouter (it stops at the first of these and total_rollout_steps): postrl stops at train.total_steps"),
    "rollout.test_freq": via(_test_freq, "fully_async: validation every that many weight syncs (postrl steps)"),
    "async_training.staleness_threshold": drop("rollout.max_staleness = ceil(threshold) policy versions (verl bounds the share of stale prompts per sync, postrl their age), with rollout.placement pool"),
    "async_training.trigger_parameter_sync_step": drop("train.global_batch_size = trigger_parameter_sync_step x require_batches x ppo_mini_batch_size (the prompts between two weight syncs)"),
    "async_training.require_batches": drop("see async_training.trigger_parameter_sync_step"),
    "async_training.partial_rollout": drop("rollout.partial_rollout (verl applies it only when staleness_threshold > 0)"),
    "async_training.use_rollout_log_probs": drop("postrl recomputes the old log-probs with the trainer's weights and weights the loss by the engine-vs-trainer ratio (algorithm.rollout_correction, on by default with rollout.max_staleness >= 1: AReaL's decoupled objective)"),
    "async_training.compute_prox_log_prob": drop("postrl always computes the proximal (old) log-probs on the trainer (algorithm.rollout_correction)"),
    "async_training.use_trainer_do_validate": drop("validation runs on the trainer (eval.freq)"),
}  # fmt: skip

VERL_PREFIXES: dict[str, str] = {
    "critic.": GAE,
    "actor_rollout_ref.actor.checkpoint.": "checkpoint contents are fixed (HF model, optimizer, scheduler, RNG): checkpoint.load_optimizer / load_rng choose what a resume restores",
    "actor_rollout_ref.actor.profiler.": LOGGING,
    "actor_rollout_ref.rollout.engine_kwargs.": "engine-specific arguments: postrl's rollout section names the vLLM settings it passes",
    "actor_rollout_ref.rollout.multi_turn.": "postrl's agent loop: rollout.multi_turn (tools, interaction, max_turns, max_tool_calls; docs/agents.md)",
    "actor_rollout_ref.rollout.agent.": "verl's agent-loop workers: postrl runs the agent loop in the rollout process, tool calls on rollout.multi_turn.tool_workers threads",
    "algorithm.kl_ctrl.": "the adaptive KL controller: postrl's KL-in-reward coefficient is fixed (algorithm.kl_ctrl.kl_coef)",
    "reward_model.model.": "the reward model's other settings: postrl's reward.reward_model (path, micro_batch_size, max_length, dtype)",
    "async_training.checkpoint_engine.": "weights travel from the trainer to the replicas by one torch.distributed broadcast per version, with a checksum (rollout.placement pool; docs/async.md)",
    "custom_reward_function.reward_kwargs.": "keyword arguments of custom_reward_function's function: with no custom_reward_function.path there is no function to pass them to",
    "ray_init.": PLACEMENT,
    "ray_kwargs.": PLACEMENT,
    "hydra.": "Hydra's own settings (where it looks for configs, where it writes its logs), nothing of the run; the config a script starts from is named by --config-path / --config-name, which postrl reads",
    "data.custom_cls.": "verl's dataset class, code postrl does not run: a path to one is refused by name (write its rows in the verl schema, `postrl preprocess`)",
}

# The heads of override keys that only verl uses: an override under one of them goes through VERL.
VERL_HEADS = ("actor_rollout_ref.", "trainer.", "reward_model.", "critic.", "custom_reward_function.", "ray_init.", "ray_kwargs.", "async_training.")

# Keys that only name things (the run, its project, where its logs and checkpoints go): a value computed by a
# command postrl does not run (`exp_$(date +%Y%m%d)`) becomes a placeholder there, with a note, not a refusal.
NAMES = frozenset({
    "trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir", "trainer.default_hdfs_dir",
    "trainer.rollout_data_dir", "trainer.validation_data_dir",
})  # fmt: skip
