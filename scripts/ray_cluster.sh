#!/usr/bin/env bash
# Start a Ray cluster for postrl the way the MindSpeed-RL / verl guides do: run this script on every
# node; the node whose CURRENT_IP equals MASTER_ADDR becomes the head, the others join it. The head
# waits until NNODES nodes with DEVICES_PER_NODE devices each are up, then runs the command given
# after `--` (if any), e.g. the training job:
#
#   MASTER_ADDR=10.0.0.1 CURRENT_IP=10.0.0.1 NNODES=2 DEVICES_PER_NODE=8 SOCKET_IFNAME=eth0 \
#     bash scripts/ray_cluster.sh -- postrl train configs/qwen25_7b_grpo.yaml cluster.launcher=ray \
#       cluster.nnodes=2 cluster.devices_per_node=8 --ray-address 10.0.0.1:6344
#   MASTER_ADDR=10.0.0.1 CURRENT_IP=10.0.0.2 NNODES=2 DEVICES_PER_NODE=8 SOCKET_IFNAME=eth0 \
#     bash scripts/ray_cluster.sh                                   # on the second node
#
# Settings (environment variables; the guides' names):
#   MASTER_ADDR       IP of the head node (required)
#   CURRENT_IP        IP of this node; every Ray process binds to it (required)
#   NNODES            number of nodes (default 1)
#   DEVICES_PER_NODE  devices per node (default 1); NPUS_PER_NODE is accepted as an alias
#   DEVICE            gpu | npu | cpu (default: gpu if nvidia-smi works, else cpu); sets the Ray resource
#                     each node advertises: --num-gpus, --resources '{"NPU": n}', or --num-cpus
#   SOCKET_IFNAME     network interface for collectives (exported as GLOO_/NCCL_/TP_/HCCL_SOCKET_IFNAME)
#   RAY_PORT          GCS port of the head (default 6344); DASHBOARD_PORT (default 8265)
#   OBJECT_STORE_MB   Ray object store size per node (default: Ray's choice)
#   WAIT_TIMEOUT      seconds to wait for the nodes / the head (default 600)
#   RAY_AUTH_MODE     token (default) | disabled; see below
#   DRY_RUN=1         print the commands instead of running them
# Stop a node with `ray stop` on it when the job is done.
set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the head node's IP}"
: "${CURRENT_IP:?set CURRENT_IP to this node's IP}"
NNODES=${NNODES:-1}
DEVICES_PER_NODE=${DEVICES_PER_NODE:-${NPUS_PER_NODE:-1}}
RAY_PORT=${RAY_PORT:-6344}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
WAIT_TIMEOUT=${WAIT_TIMEOUT:-600}
DRY_RUN=${DRY_RUN:-0}
if [ -z "${DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
fi

if [ "${1:-}" = "--" ]; then shift; fi
JOB=("$@")

# Ray >= 2.5x starts clusters with token authentication; clients (ray status, the training driver)
# must then use it too. The token is ~/.ray/auth_token of the head: copy it to the other nodes (or set
# RAY_AUTH_TOKEN there). RAY_AUTH_MODE=disabled turns authentication off on a trusted network.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# Token authentication exists from Ray 2.52 (the `ray` extra of pyproject.toml asks for it); an older Ray
# ignores RAY_AUTH_MODE and starts a cluster that anyone who reaches its ports can use.
if [ "$RAY_AUTH_MODE" = token ]; then
  RAY_VERSION=$(ray --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -n 1 || true)
  if [ -z "$RAY_VERSION" ] || ! printf '2.52\n%s\n' "$RAY_VERSION" | sort -V -C; then
    echo "RAY_AUTH_MODE=token needs Ray 2.52 or newer (token authentication), found ${RAY_VERSION:-no \`ray\` command}:" \
      "an older Ray would start the cluster without authentication. Fix: pip install 'postrl[ray]' (ray[train]>=2.52)," \
      "or set RAY_AUTH_MODE=disabled to run without authentication on a trusted network." >&2
    exit 2
  fi
fi

if [ -n "${SOCKET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME=$SOCKET_IFNAME NCCL_SOCKET_IFNAME=$SOCKET_IFNAME
  export TP_SOCKET_IFNAME=$SOCKET_IFNAME HCCL_SOCKET_IFNAME=$SOCKET_IFNAME
fi

case "$DEVICE" in
  gpu) RESOURCES=(--num-gpus "$DEVICES_PER_NODE"); RESOURCE_NAME=GPU ;;
  npu) RESOURCES=(--resources "{\"NPU\": $DEVICES_PER_NODE}"); RESOURCE_NAME=NPU ;;
  cpu) RESOURCES=(--num-cpus "${NUM_CPUS:-$DEVICES_PER_NODE}"); RESOURCE_NAME=CPU ;;
  *) echo "DEVICE must be gpu, npu or cpu (got '$DEVICE')" >&2; exit 2 ;;
esac
EXTRA=()
if [ -n "${OBJECT_STORE_MB:-}" ]; then EXTRA+=(--object-store-memory $((OBJECT_STORE_MB * 1024 * 1024))); fi

run() {
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# Devices of RESOURCE_NAME the cluster has, from `ray status` ("0.0/16.0 GPU").
cluster_devices() {
  ray status --address "$MASTER_ADDR:$RAY_PORT" 2>/dev/null \
    | grep -oE "/[0-9]+(\.[0-9]+)? $RESOURCE_NAME\b" | head -n 1 | tr -dc '0-9.' | cut -d. -f1
}

if [ "$CURRENT_IP" = "$MASTER_ADDR" ]; then
  run ray start --head --node-ip-address "$CURRENT_IP" --port "$RAY_PORT" \
    --dashboard-host "$CURRENT_IP" --dashboard-port "$DASHBOARD_PORT" "${RESOURCES[@]}" "${EXTRA[@]}" --disable-usage-stats
  want=$((NNODES * DEVICES_PER_NODE))
  if [ "$DRY_RUN" != 1 ]; then
    waited=0
    until [ "$(cluster_devices || echo 0)" -ge "$want" ] 2>/dev/null; do
      if [ "$waited" -ge "$WAIT_TIMEOUT" ]; then
        echo "only $(cluster_devices || echo 0) of $want $RESOURCE_NAME devices joined in ${WAIT_TIMEOUT}s; check the worker nodes" >&2
        exit 1
      fi
      echo "waiting for $NNODES nodes x $DEVICES_PER_NODE $RESOURCE_NAME (have $(cluster_devices || echo 0) of $want)"
      sleep 5; waited=$((waited + 5))
    done
    echo "Ray cluster ready at $MASTER_ADDR:$RAY_PORT: $want $RESOURCE_NAME devices on $NNODES node(s)"
  fi
  if [ "${#JOB[@]}" -gt 0 ]; then run "${JOB[@]}"; fi
else
  waited=0
  until run ray start --address "$MASTER_ADDR:$RAY_PORT" --node-ip-address "$CURRENT_IP" "${RESOURCES[@]}" "${EXTRA[@]}" --disable-usage-stats; do
    if [ "$waited" -ge "$WAIT_TIMEOUT" ]; then echo "could not join the head at $MASTER_ADDR:$RAY_PORT" >&2; exit 1; fi
    echo "head $MASTER_ADDR:$RAY_PORT not reachable yet; retrying"
    sleep 5; waited=$((waited + 5))
  done
fi
