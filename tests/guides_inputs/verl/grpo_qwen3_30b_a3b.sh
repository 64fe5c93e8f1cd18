# Written for postrl's tests in the style of verl's Qwen3-30B-A3B FSDP scripts (GSPO loss, MoE, token budgets
# by arithmetic, names stamped with the date).
set -xeuo pipefail

NOW=$(date +%Y%m%d_%H%M)
project_name=${PROJECT_NAME:-"qwen3-30b-a3b"}
exp_name=${EXPERIMENT_NAME:-"gspo-fsdp-$(date +%m%d)"}
CKPTS_DIR=${CKPTS_DIR:-"${HOME}/ckpts/${project_name}/${exp_name}_${NOW}"}

NNODES=${NNODES:-2}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}

max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 6))
actor_ppo_max_token_len=$(( (max_prompt_length + max_response_length) * 2 ))
infer_ppo_max_token_len=$(( $actor_ppo_max_token_len * 3 / 2 ))

train_prompt_bsz=256
n_resp_per_prompt=8
train_prompt_mini_bsz=$((train_prompt_bsz / 4))
gen_tp=4
ep_size=${gen_tp}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="${HOME}/data/dapo-math-17k.parquet" \
    data.val_files="${HOME}/data/aime-2024.parquet" \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.train_batch_size=${train_prompt_bsz} \
    actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
    actor_rollout_ref.model.path="Qwen/Qwen3-30B-A3B-Base" \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.policy_loss.loss_mode=gspo \
    actor_rollout_ref.actor.clip_ratio_low=0.0003 \
    actor_rollout_ref.actor.clip_ratio_high=0.0004 \
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_ppo_max_token_len} \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${infer_ppo_max_token_len} \
    actor_rollout_ref.rollout.max_num_batched_tokens=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.rollout.tensor_model_parallel_size=${gen_tp} \
    actor_rollout_ref.rollout.expert_parallel_size=${ep_size} \
    actor_rollout_ref.rollout.name=vllm \
    trainer.logger='["console"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${exp_name}" \
    trainer.default_local_dir="${CKPTS_DIR}" \
    trainer.nnodes="${NNODES}" \
    trainer.n_gpus_per_node="${NGPUS_PER_NODE}" \
    trainer.total_training_steps=200 "$@"
