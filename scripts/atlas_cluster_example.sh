#!/usr/bin/env bash
# Example: an E-P-D deployment over two Atlas 800I A2 / A3 servers, driven from a login node
# with ssh. Adjust host names, NPU lists and paths; every server needs the same MODEL path,
# this repository at REPO, and epdserve installed (pip install epdserve[npu]).
#
#   NODE_E  (head): the scheduler + 8 E instances (NPU 0-7)
#   NODE_PD:        4 P instances (NPU 0-3) + 4 D instances (NPU 4-7); the KV hop stays on
#                   this server, the features come over the network through the MM Store
#   MM Store:       the Redis the cluster already runs (MM_STORE), password-protected or TLS;
#                   nothing here starts or opens a Redis.
#
#   MM_STORE='redis://:PASSWORD@10.0.0.5:6379/0' NODE_E=atlas-01 NODE_PD=atlas-02 \
#     scripts/atlas_cluster_example.sh
#
# Each server runs `atlas_node.sh ... preflight` first; a missing driver, CANN or free HBM stops
# the whole launch with that server's message. Ctrl-C here stops everything: closing an ssh
# session sends SIGHUP to its script, whose trap stops the processes it started.
set -euo pipefail

NODE_E=${NODE_E:-atlas-01}
NODE_PD=${NODE_PD:-atlas-02}
HEAD_IP=${HEAD_IP:-$(getent hosts "$NODE_E" | awk '{print $1; exit}')}
MODEL=${MODEL:-/data/models/Qwen2-VL-7B-Instruct}
REPO=${REPO:-/opt/epdserve}   # where scripts/atlas_node.sh lives on the servers
MM_STORE=${MM_STORE:?set MM_STORE to the cluster Redis URL, e.g. redis://:PASSWORD@10.0.0.5:6379/0}
[[ -n "$HEAD_IP" ]] || { echo "cannot resolve $NODE_E: set HEAD_IP" >&2; exit 1; }

# Settings travel as one env prefix on the remote command line, each value shell-quoted.
common=$(printf '%q ' "MODEL=$MODEL" "HEAD_IP=$HEAD_IP" "MM_STORE=$MM_STORE" "MODE=E-P-D")

on() {  # on HOST ARGS...: atlas_node.sh ARGS on HOST, in the foreground of an ssh session
  local host=$1; shift
  ssh -tt "$host" "cd $(printf '%q' "$REPO") && env $common bash scripts/atlas_node.sh $*"
}

on "$NODE_E" preflight 0,1,2,3,4,5,6,7
on "$NODE_PD" preflight 0,1,2,3,4,5,6,7

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait || true' EXIT INT TERM
on "$NODE_E" head & pids+=($!)
sleep 20   # the scheduler loads the tokenizer and image processor; instances retry registration anyway
on "$NODE_E" instances E 0,1,2,3,4,5,6,7 & pids+=($!)
on "$NODE_PD" instances P 0,1,2,3 & pids+=($!)
on "$NODE_PD" instances D 4,5,6,7 & pids+=($!)

echo "serving at grpc://$HEAD_IP:50051 once the instances have registered; check with:"
echo "  grpcurl -plaintext $HEAD_IP:50051 epdserve.v1.EPDServe/GetServerInfo"
wait
