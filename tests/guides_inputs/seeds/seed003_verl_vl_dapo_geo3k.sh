# seed 003: the verl guide's Qwen2.5-VL-7B DAPO run on geo3k, with the newer reward-manager key.
# RECONSTRUCTED: the guide's own file was not available to this session; the keys follow verl's
# examples (geo3k, the DAPO recipe), and `reward_model.reward_manager.name=dapo` is as issue 38 quotes it.
python3 -m recipe.dapo.main_dapo \
    algorithm.adv_estimator=grpo \
    data.train_files=data/geo3k/train.parquet \
    data.val_files=data/geo3k/test.parquet \
    data.train_batch_size=64 \
    data.gen_batch_size=96 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.image_key=images \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-VL-7B-Instruct \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.expert_parallel_size=1 \
    actor_rollout_ref.ref.strategy=fsdp2 \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=10 \
    reward_model.reward_manager.name=dapo \
    reward_model.overlong_buffer.enable=True \
    reward_model.overlong_buffer.len=512 \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_training_steps=100
