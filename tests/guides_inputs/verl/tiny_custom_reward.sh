# Written for postrl's tests: a verl GRPO script sized for the tiny model, scoring with its own reward file.
set -x
REWARD_FILE=${REWARD_FILE:-./gsm8k_reward.py}
max_response_length=$((4 * 3))

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=builtin:arithmetic:train \
    data.train_batch_size=4 \
    data.max_response_length=${max_response_length} \
    actor_rollout_ref.model.path=builtin:tiny-qwen2 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    custom_reward_function.path="${REWARD_FILE}" \
    custom_reward_function.name=compute_score \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.val_before_train=False \
    trainer.save_freq=-1 \
    trainer.total_training_steps=5 $@
