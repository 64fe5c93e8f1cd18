"""MindSpeed-RL's keys (its YAML sections and flat keys) in postrl's names (docs/guides.md)."""

from __future__ import annotations


from postrl.guides.rules import (
    ARCH,
    ASCEND,
    DATA,
    FUSED,
    GAE,
    LOGGING,
    MEGATRON,
    PARALLEL,
    PLACEMENT,
    Rule,
    _adv,
    _bool,
    _devices,
    _filter_metric,
    _if_true,
    _kl,
    _negate,
    _schedule,
    drop,
    to,
    via,
)


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
    "stage": via(lambda v: {"algorithm.name": "dapo" if "dapo" in str(v) else "grpo"} if str(v) in ("ray_grpo", "ray_dapo") else None, "postrl trains ray_grpo / ray_dapo", strict=True),
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
    "load": via(lambda v: {"checkpoint.resume": str(v)} if v else {}, "resume from this checkpoint directory (docs/checkpoints.md)"),
    "ref_model_load_path": to("checkpoint.ref_model_path", "the reference model's Hugging Face weights"),
    "use_deter_comp": to("train.deterministic"),
    "context_parallel_size": to("train.sequence_parallel_size", "Ulysses sequence parallelism (context_parallel_algo: ulysses_cp_algo, MindSpeed's default)"),
    "actor_resource.num_npus": via(_devices, "the cluster size: 8 devices per node, as the guides' Atlas 800T A2 nodes"),
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
    "gamma": to("algorithm.gamma", "PPO (adv_estimator: gae) only"),
    "lam": to("algorithm.lam", "PPO (adv_estimator: gae) only"),
    "cliprange_value": drop(GAE),
    "actor_forward_micro_batch_size": to("train.log_prob_micro_batch_size"),
    "ref_forward_micro_batch_size": to("train.log_prob_micro_batch_size"),
    "adv_estimator": via(_adv, "postrl's estimators: grpo (= group_norm), drgrpo, rloo, reinforce_plus_plus(_seq, _baseline), gae (PPO with postrl's critic section)", strict=True),
    "kl_penalty": via(_kl),
    "kl_ctrl_type": via(lambda v: {} if v == "fixed" else None, "postrl's KL coefficient is fixed"),
    "init_kl_coef": to("algorithm.kl.coef"),
    "use_kl_in_reward": via(lambda v: {"algorithm.use_kl_in_reward": _bool(v)}, "PPO (gae) only; init_kl_coef is then the reward's coefficient"),
    "mini_batch_size": to("train.mini_batch_size"),
    "max_prompt_length": to("data.max_prompt_length"),
    "epochs": to("train.epochs_per_batch"),
    "clip_ratio": via(lambda v: {"algorithm.clip_ratio_low": v, "algorithm.clip_ratio_high": v}, "both sides, unless clip_higher_enable"),
    "entropy_coeff": to("algorithm.entropy_coef"),
    "shuffle_mini_batch": drop("mini-batches keep the batch's order"),
    "n_samples_per_prompt": to("rollout.n_samples_per_prompt"),
    "rule_reward": via(lambda v: {} if _bool(v) else None, "postrl's reward always includes its rule verifiers (reward.verifiers)"),
    "verifier_function": drop("converted with verifier_weight to reward.verifiers"),
    "verifier_weight": drop("converted with verifier_function to reward.verifiers"),
    "verifier_parallel": to("reward.workers"),
    "verifier_timeout": to("reward.timeout_s"),
    "log_max_throughput": drop(LOGGING),
    "use_tensorboard": via(lambda v: {}, "converted to logging.sinks"),
    "use_wandb": via(lambda v: {}, "converted to logging.sinks"),
    "token_level_loss": via(lambda v: {"algorithm.loss_agg_mode": "token-mean" if _bool(v) else "seq-mean-token-mean"}),
    "clip_higher_enable": via(lambda v: {} if _bool(v) in (True, False) else None, "true: clip_ratio_low / clip_ratio_high; false: clip_ratio both sides"),
    "clip_ratio_low": via(lambda v: {}, "used when clip_higher_enable (algorithm.clip_ratio_low)"),
    "clip_ratio_high": via(lambda v: {}, "used when clip_higher_enable (algorithm.clip_ratio_high)"),
    "overlong_buffer_enable": via(lambda v: {"algorithm.overlong_buffer.enable": _bool(v)}),
    "overlong_buffer": to("algorithm.overlong_buffer.len"),
    "overlong_buffer_penalty_factor": to("algorithm.overlong_buffer.penalty_factor"),
    "rollout_max_tokens": to("rollout.max_tokens"),
    "filter_groups_enable": via(lambda v: {"algorithm.filter_groups.enable": _bool(v)}),
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
    "reward_config.": "the Megatron settings of MindSpeed's reward-model worker: postrl's reward model is reward.reward_model (a Hugging Face sequence classifier: path, micro_batch_size; docs/rewards.md)",
}
MINDSPEED_SECTIONS = ("megatron_training", "actor_config", "rl_config", "generate_config")
