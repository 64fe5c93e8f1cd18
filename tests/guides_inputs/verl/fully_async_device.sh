#!/usr/bin/env bash
# Written for postrl's tests in the style of verl's fully_async_policy shells: the device found by a command,
# settings chosen by `case` on it, the Rollouter's and the Trainer's devices, the staleness bound.
set -xeuo pipefail

DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' >/dev/null 2>&1 && echo npu || echo gpu)}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-dapo-qwen2.5-7b-async_$(date +%Y%m%d_%H%M)}

case "${DEVICE}" in
    npu|ascend)
        rollout_name=vllm
        loss_agg_mode=seq-mean-token-mean
        NGPUS_PER_NODE=${NGPUS_PER_NODE:-16}
        ;;
    *)
        rollout_name=vllm
        loss_agg_mode=token-mean
        NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
        ;;
esac

rollout_mode="async"
if [ "$rollout_mode" = "async" ]; then
    export VLLM_USE_V1=1
    return_raw_chat="True"
fi

max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
n_gpus_rollout=$((NGPUS_PER_NODE / 2))
n_gpus_training=$((NGPUS_PER_NODE - n_gpus_rollout))
gen_tp=2

train_prompt_bsz=0
gen_prompt_bsz=1
train_prompt_mini_bsz=32
require_batches=2
trigger_parameter_sync_step=4
total_rollout_steps=$(((train_prompt_mini_bsz * require_batches * trigger_parameter_sync_step * 50)))
staleness_threshold=0.5
partial_rollout=True

python -m verl.experimental.fully_async_policy.fully_async_main \
    data.train_files="${HOME}/data/dapo-math-17k.parquet" \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.train_batch_size=${train_prompt_bsz} \
    data.gen_batch_size=${gen_prompt_bsz} \
    data.return_raw_chat=${return_raw_chat} \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.model.path="Qwen/Qwen2.5-Math-7B" \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.loss_agg_mode=${loss_agg_mode} \
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(((max_prompt_length + max_response_length) * 2)) \
    actor_rollout_ref.rollout.name=${rollout_name} \
    actor_rollout_ref.rollout.mode=${rollout_mode} \
    actor_rollout_ref.rollout.tensor_model_parallel_size=${gen_tp} \
    actor_rollout_ref.hybrid_engine=False \
    reward_model.reward_manager=dapo \
    trainer.experiment_name="${EXPERIMENT_NAME}" \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node="${n_gpus_training}" \
    rollout.nnodes=1 \
    rollout.n_gpus_per_node="${n_gpus_rollout}" \
    rollout.total_rollout_steps="${total_rollout_steps}" \
    rollout.test_freq=10 \
    async_training.staleness_threshold="${staleness_threshold}" \
    async_training.trigger_parameter_sync_step="${trigger_parameter_sync_step}" \
    async_training.require_batches="${require_batches}" \
    async_training.partial_rollout="${partial_rollout}" \
    async_training.use_rollout_log_probs=True
