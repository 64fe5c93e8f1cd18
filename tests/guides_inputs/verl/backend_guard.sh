#!/usr/bin/env bash
# A launch script in the style of verl's examples/grpo_trainer shells, written for postrl's tests (issue 64):
# the backend is guarded, settings are chosen by compound tests, and text that looks like settings is printed.
set -xeuo pipefail

DEVICE=${DEVICE:-gpu}
INFER_BACKEND=${INFER_BACKEND:-vllm}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
# actor_rollout_ref.actor.optim.lr=1e-3 is what an older version of this script used

if [ "${DEVICE}" = npu ] && [ "${INFER_BACKEND}" = trtllm ]; then
    echo "INFER_BACKEND=trtllm is only supported with DEVICE=gpu" >&2
    exit 1
fi

if [[ "$DEVICE" == np* && -n "$INFER_BACKEND" ]] || [ "$DEVICE" = ascend ]; then
    loss_agg_mode=seq-mean-token-mean
    rollout_name=vllm
elif ! [ "$INFER_BACKEND" != vllm ]; then
    loss_agg_mode=token-mean
    rollout_name=vllm
else
    loss_agg_mode=token-mean
    rollout_name=hf
fi
[ -z "${EXPERIMENT:-}" ] && EXPERIMENT=guard-${DEVICE}
[ "$DEVICE" = gpu ] || printf 'trainer.n_gpus_per_node=%s\n' 8

cat > /tmp/notes.txt <<EOF
actor_rollout_ref.rollout.n=64
EOF

printf "%s\n" "running with data.train_batch_size=1 as a smoke test"
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.train_batch_size=64 \
    actor_rollout_ref.model.path=$MODEL_PATH \
    actor_rollout_ref.actor.loss_agg_mode=$loss_agg_mode \
    actor_rollout_ref.rollout.name=$rollout_name \
    actor_rollout_ref.rollout.n=4 \
    trainer.experiment_name=$EXPERIMENT 2>&1 | tee train.log
