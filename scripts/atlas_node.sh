#!/usr/bin/env bash
# Start epdserve processes on ONE Atlas server (Ascend NPUs), in the foreground.
#
#   scripts/atlas_node.sh head                      # MM Store (Redis) + scheduler on this server
#   scripts/atlas_node.sh instances E  0            # one E instance on NPU 0
#   scripts/atlas_node.sh instances P  0,1,2,3      # one P instance per NPU
#   scripts/atlas_node.sh instances EP 4,5          # co-located E+P per NPU (stream core limits)
#   scripts/atlas_node.sh instances D  6,7
#
# Every process started here runs in this script's process group; Ctrl-C / SIGTERM / the
# ssh session closing stops them all (and `epdserve instance` deregisters on the way out).
#
# Settings (environment; defaults in brackets):
#   MODEL            checkpoint directory, same path on every server          [required]
#   HEAD_IP          address of the head server (scheduler + MM Store)       [required for instances]
#   NODE_IP          this server's address on the HCCL / data network         [first address of `hostname -I`]
#   NIC              network interface of NODE_IP (HCCL/GLOO socket ifname)   [found from NODE_IP]
#   SCHED_PORT       scheduler's public + registry port                      [50051]
#   REDIS_PORT       MM Store port on the head server                        [6379]
#   MM_STORE         MM Store URL                                             [redis://$HEAD_IP:$REDIS_PORT/0]
#   MODE             mode name reported by the scheduler                      [E-P-D]
#   KV_CACHE_MB      KV cache per P/D worker                                  [16384]
#   EXTRA_ARGS       extra `epdserve instance` flags                          []
#   ASCEND_ENV       CANN set_env.sh   [/usr/local/Ascend/ascend-toolkit/set_env.sh, else .../cann/set_env.sh]
set -euo pipefail

what=${1:?usage: atlas_node.sh head | instances ROLES NPU_LIST}

# ---- Ascend environment: CANN's set_env.sh (newer CANN: cann/set_env.sh), and ATB's for its ops
for f in "${ASCEND_ENV:-}" /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/cann/set_env.sh; do
  if [[ -n "$f" && -f "$f" ]]; then source "$f"; break; fi
done
[[ -f /usr/local/Ascend/nnal/atb/set_env.sh ]] && source /usr/local/Ascend/nnal/atb/set_env.sh  # ATB paged-attention ops

NODE_IP=${NODE_IP:-$(hostname -I | awk '{print $1}')}
NIC=${NIC:-$(ip -o -4 addr show | awk -v ip="$NODE_IP" '$4 ~ "^"ip"/" {print $2; exit}')}
export HCCL_IF_IP=$NODE_IP                 # HCCL's host-side socket address (P->D pairs)
export HCCL_SOCKET_IFNAME=${NIC}
export GLOO_SOCKET_IFNAME=${NIC}
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-120}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-600}
export P2P_HCCL_BUFFSIZE=${P2P_HCCL_BUFFSIZE:-20}   # MB per two-rank P2P communicator (one per P-D pair)
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export TASK_QUEUE_ENABLE=1

SCHED_PORT=${SCHED_PORT:-50051}
REDIS_PORT=${REDIS_PORT:-6379}
MODEL=${MODEL:?set MODEL to the checkpoint directory (same path on every server)}
MODE=${MODE:-E-P-D}

pids=()
cleanup() {
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait || true
}
trap cleanup EXIT INT TERM

case "$what" in
  head)
    if [[ -z "${MM_STORE:-}" ]]; then
      command -v redis-server >/dev/null || { echo "redis-server not found; set MM_STORE=redis://host:port" >&2; exit 1; }
      redis-server --port "$REDIS_PORT" --bind 0.0.0.0 --protected-mode no --save "" --appendonly no \
                   --maxmemory "${REDIS_MAXMEMORY:-64gb}" --maxmemory-policy allkeys-lru &
      pids+=($!)
    fi
    epdserve scheduler --model "$MODEL" --host 0.0.0.0 --port "$SCHED_PORT" --mode "$MODE" &
    pids+=($!)
    echo "head: scheduler on $NODE_IP:$SCHED_PORT, MM Store ${MM_STORE:-redis://$NODE_IP:$REDIS_PORT/0}"
    ;;
  instances)
    roles=${2:?instances needs ROLES (E, P, D, EP, ED, PD or EPD)}
    npus=${3:?instances needs a comma-separated NPU list, e.g. 0,1,2,3}
    HEAD_IP=${HEAD_IP:?set HEAD_IP to the head server address}
    MM_STORE=${MM_STORE:-redis://$HEAD_IP:$REDIS_PORT/0}
    IFS=, read -ra devs <<< "$npus"
    for dev in "${devs[@]}"; do
      # One NPU per instance process: it sees only its own device, as npu:0.
      ASCEND_RT_VISIBLE_DEVICES=$dev epdserve instance --roles "$roles" --model "$MODEL" --device npu \
        --scheduler "$HEAD_IP:$SCHED_PORT" --mm-store "$MM_STORE" --host "$NODE_IP" --bind-host 0.0.0.0 \
        --kv-cache-mb "${KV_CACHE_MB:-16384}" ${EXTRA_ARGS:-} &
      pids+=($!)
    done
    echo "started ${#devs[@]} $roles instance(s) on NPUs $npus of $NODE_IP"
    ;;
  *)
    echo "usage: atlas_node.sh head | instances ROLES NPU_LIST" >&2; exit 2 ;;
esac

wait -n || true   # the first process to exit (or a signal) stops the rest
