#!/usr/bin/env bash
# Written for postrl's tests in the style of verl's ReTool recipe: multi-turn rollout with SandboxFusion's code tool.
set -x
tool_config_path=sandbox_fusion_tool_config.yaml
max_turns=8
max_response_length=$((1024 * 4))

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=builtin:arithmetic:train \
    data.train_batch_size=32 \
    data.max_response_length=$max_response_length \
    actor_rollout_ref.model.path=builtin:tiny-qwen2 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.multi_turn.enable=True \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=$max_turns \
    actor_rollout_ref.rollout.multi_turn.tool_config_path=$tool_config_path \
    actor_rollout_ref.actor.policy_loss.loss_mode=sapo \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    trainer.total_training_steps=10 "$@"
