#!/usr/bin/env bash
# Example: an E-P-D deployment over two Atlas 800I A2 / A3 servers, driven from a login node
# with ssh. Adjust host names, NPU lists and paths; every server needs the same MODEL path,
# this repository at REPO, and epdserve installed (pip install epdserve[npu]).
#
#   NODE_E  (head): the scheduler + 8 E instances (NPU 0-7)
#   NODE_PD:        4 P instances (NPU 0-3) + 4 D instances (NPU 4-7); the KV hop stays on
#                   this server, the features come over the network through the MM Store
#   MM Store:       the Redis the cluster already runs (MM_STORE, no password in the URL),
#                   password-protected or TLS; nothing here starts or opens a Redis.
#
#   scripts/atlas_node.sh new-env       # once: ~/.epdserve/env, a random cluster token + API key;
#                                       # add EPDSERVE_MM_STORE_PASSWORD=... for the Redis
#   MM_STORE='redis://10.0.0.5:6379/0' NODE_E=atlas-01 NODE_PD=atlas-02 \
#     scripts/atlas_cluster_example.sh
#
# Secrets: EPDSERVE_ENV_FILE (default ~/.epdserve/env, mode 0600) is copied to ~/.epdserve/env
# on each server over ssh's stdin (created 0600 there; its content is never in any argv), and
# atlas_node.sh sources it there. Only non-secret settings ride the ssh command line. INSECURE=1
# (a closed lab only) runs without an env file and without API key or cluster token checks.
#
# Each server runs `atlas_node.sh ... preflight` first; a missing driver, CANN or free HBM stops
# the whole launch with that server's message. Ctrl-C here stops everything: closing an ssh
# session sends SIGHUP to its script, whose trap stops the processes it started.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODE_E=${NODE_E:-atlas-01}
NODE_PD=${NODE_PD:-atlas-02}
HEAD_IP=${HEAD_IP:-$(getent hosts "$NODE_E" | awk '{print $1; exit}')}
PD_IP=${PD_IP:-$(getent hosts "$NODE_PD" | awk '{print $1; exit}' || true)}   # NODE_PD's cluster address
MODEL=${MODEL:-/data/models/Qwen2-VL-7B-Instruct}
REPO=${REPO:-/opt/epdserve}   # where scripts/atlas_node.sh lives on the servers
MM_STORE=${MM_STORE:?set MM_STORE to the cluster Redis URL, e.g. redis://10.0.0.5:6379/0 (its password in the env file)}
SCHED_PORT=${SCHED_PORT:-50051}
REG_PORT=${REG_PORT:-50052}
ENV_FILE=${EPDSERVE_ENV_FILE:-$HOME/.epdserve/env}
[[ -n "$HEAD_IP" ]] || { echo "cannot resolve $NODE_E: set HEAD_IP" >&2; exit 1; }
[[ -n "$PD_IP" ]] || { echo "cannot resolve $NODE_PD: set PD_IP" >&2; exit 1; }

# Refuse here what the servers would refuse (an unsafe env file, a password in MM_STORE), before
# anything is copied or started: the head needs the API key, so check as the head does.
DEVICE=cpu MM_STORE=$MM_STORE EPDSERVE_ENV_FILE=$ENV_FILE bash "$here/atlas_node.sh" check-env head >/dev/null

# Settings travel as one env prefix on the remote command line, each value shell-quoted: none of
# them is a secret.
common=$(printf '%q ' "MODEL=$MODEL" "HEAD_IP=$HEAD_IP" "MM_STORE=$MM_STORE" "MODE=E-P-D" \
  "SCHED_PORT=$SCHED_PORT" "REG_PORT=$REG_PORT" "INSECURE=${INSECURE:-0}")
# Each stage its own tensor-parallel degree (atlas_node.sh), passed on when set: e.g. ENCODE_...=1,
# PREFILL_...=2 and DECODE_...=4 start P0 on NPUs 0,1 and P1 on 2,3, D0 on 4-7 (the NPU lists below
# must split into groups of each degree; P and D only at a pair the KV hop carries).
for v in TENSOR_PARALLEL_SIZE ENCODE_TENSOR_PARALLEL_SIZE PREFILL_TENSOR_PARALLEL_SIZE DECODE_TENSOR_PARALLEL_SIZE; do
  if [[ -n "${!v:-}" ]]; then common+=$(printf '%q ' "$v=${!v}"); fi
done

push_env() {  # push_env HOST [instances]: the env file to HOST:~/.epdserve/env, over ssh's stdin (mode 0600);
  # an instance-only server gets it without EPDSERVE_API_KEY (clients' key: no instance needs it)
  local drop='^$'
  if [[ "${2:-}" == instances ]]; then drop='^[[:space:]]*(export[[:space:]]+)?EPDSERVE_API_KEY='; fi
  # shellcheck disable=SC2016  # $HOME and $t expand on the server
  grep -Ev "$drop" "$ENV_FILE" | ssh "$1" 'umask 077 && mkdir -p "$HOME/.epdserve" &&
            t=$(mktemp "$HOME/.epdserve/env.XXXXXX") && cat > "$t" && mv -f "$t" "$HOME/.epdserve/env"'
}

on() {  # on HOST ARGS...: atlas_node.sh ARGS on HOST, in the foreground of an ssh session
  local host=$1; shift
  ssh -tt "$host" "cd $(printf '%q' "$REPO") && env $common ${ON_ENV:-} bash scripts/atlas_node.sh $*"
}

if [[ -e "$ENV_FILE" ]]; then push_env "$NODE_E"; push_env "$NODE_PD" instances; fi
on_e=$(printf '%q' "NODE_IP=$HEAD_IP")   # every port of a server binds its cluster address, never a guess
on_pd=$(printf '%q' "NODE_IP=$PD_IP")
ON_ENV="$on_e ROLES=E" on "$NODE_E" preflight 0,1,2,3,4,5,6,7   # E holds no KV cache: sized for weights + margin
ON_ENV="$on_pd ROLES=P" on "$NODE_PD" preflight 0,1,2,3   # each at its role's degree
ON_ENV="$on_pd ROLES=D" on "$NODE_PD" preflight 4,5,6,7

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait || true' EXIT INT TERM
# The scheduler binds HEAD_IP, the address instances register at.
ON_ENV=$on_e on "$NODE_E" head & pids+=($!)
sleep 20   # the scheduler loads the tokenizer and image processor; instances retry registration anyway
ON_ENV=$on_e on "$NODE_E" instances E 0,1,2,3,4,5,6,7 & pids+=($!)
ON_ENV=$on_pd on "$NODE_PD" instances P 0,1,2,3 & pids+=($!)
ON_ENV=$on_pd on "$NODE_PD" instances D 4,5,6,7 & pids+=($!)

echo "serving at grpc://$HEAD_IP:$SCHED_PORT once the instances have registered (clients send EPDSERVE_API_KEY); check with:"
echo "  (set -a; . $ENV_FILE; epdserve doctor --scheduler $HEAD_IP:$SCHED_PORT)"
wait
