#!/usr/bin/env bash
# Example: an E-P-D deployment over three Atlas 800I A2 servers (8 NPUs each), driven from a
# login node with ssh. Adjust the host names, NPU lists and paths; every server needs the same
# MODEL path and epdserve installed (pip install epdserve[npu]).
#
#   server-a (head): scheduler + MM Store, 2 E instances (NPU 0,1), 6 P instances (NPU 2-7)
#   server-b:        8 D instances
#   server-c:        4 EP instances (co-located encode + prefill), 4 D instances
#
# Ctrl-C here stops everything: closing an ssh session sends SIGHUP to its script, whose trap
# stops the processes it started.
set -euo pipefail

HEAD=${HEAD:-server-a}
HEAD_IP=${HEAD_IP:-$(getent hosts "$HEAD" | awk '{print $1}')}
MODEL=${MODEL:-/data/models/Qwen2-VL-7B-Instruct}
REPO=${REPO:-/opt/epdserve}   # where scripts/atlas_node.sh lives on the servers
common="MODEL=$MODEL HEAD_IP=$HEAD_IP MODE=E-P-D"

pids=()
run() {  # run HOST ARGS...: atlas_node.sh on HOST in the foreground of an ssh session
  local host=$1; shift
  ssh -tt "$host" "cd $REPO && $common bash scripts/atlas_node.sh $*" &
  pids+=($!)
}
trap 'kill ${pids[*]} 2>/dev/null || true; wait || true' EXIT INT TERM

run "$HEAD" head
sleep 20   # the scheduler loads the tokenizer and image processor; instances retry registration anyway
run "$HEAD" instances E 0,1
run "$HEAD" instances P 2,3,4,5,6,7
run server-b instances D 0,1,2,3,4,5,6,7
run server-c instances EP 0,1,2,3
run server-c instances D 4,5,6,7

echo "serving at grpc://$HEAD_IP:50051 once the instances have registered; check with:"
echo "  grpcurl -plaintext $HEAD_IP:50051 epdserve.v1.EPDServe/GetServerInfo"
wait
