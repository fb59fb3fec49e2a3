#!/usr/bin/env bash
# Start epdserve processes on ONE Atlas 800I A2 / A3 server (Ascend NPUs), in the foreground.
#
#   scripts/atlas_node.sh preflight 0,1,2,3         # check this server only (driver, CANN, free HBM)
#   scripts/atlas_node.sh head                      # the scheduler (no NPU needed)
#   scripts/atlas_node.sh instances E  0            # one E instance on NPU 0
#   scripts/atlas_node.sh instances P  0,1,2,3      # one P instance per NPU
#   scripts/atlas_node.sh instances EP 4,5          # co-located E+P per NPU (stream core limits)
#   scripts/atlas_node.sh instances D  6,7
#
# `instances` runs the preflight first and stops with one line saying what is missing.
# Every process started here is stopped when this script gets Ctrl-C / SIGTERM / SIGHUP (the
# ssh session closing), and `epdserve instance` deregisters on the way out.
#
# Settings (environment; defaults in brackets):
#   MODEL            checkpoint directory, same path on every server          [required]
#   HEAD_IP          address of the scheduler's server                        [required for instances]
#   MM_STORE         MM Store URL of a Redis the cluster already runs, e.g.
#                    rediss://:PASSWORD@redis.example:6380/0 (TLS) or
#                    redis://:PASSWORD@10.0.0.5:6379/0                        [required for instances]
#   NODE_IP          this server's address on the HCCL / data network         [first address of `hostname -I`]
#   NIC              network interface of NODE_IP (HCCL/GLOO socket ifname)   [found from NODE_IP]
#   SCHED_PORT       scheduler's public + registry port                      [50051]
#   MODE             mode name reported by the scheduler                      [E-P-D]
#   KV_CACHE_MB      KV cache per P/D worker                                  [16384]
#   MIN_FREE_HBM_MB  preflight: free HBM each listed NPU must have            [KV_CACHE_MB + 20480]
#   HCCL_HOST_SOCKET_PORT_RANGE  host ports HCCL may use (open them between servers) [60000-60099]
#   EXTRA_ARGS       extra `epdserve instance` flags, split on spaces         []
#   ASCEND_ENV       CANN set_env.sh   [/usr/local/Ascend/ascend-toolkit/set_env.sh, else .../cann/set_env.sh]
#   ASCEND_HOME      Ascend install root (driver/version.info)                [/usr/local/Ascend]
#
# The MM Store's Redis is NOT started here: point MM_STORE at the cluster's own Redis, which
# should require a password or an ACL user (or TLS) and listen only on the cluster network. A
# password inside the URL is visible in `ps` on this server as an `epdserve instance` argument:
# export EPDSERVE_MM_STORE_PASSWORD (and EPDSERVE_MM_STORE_USERNAME for an ACL user) instead and
# leave it out of MM_STORE. EPDSERVE_CLUSTER_TOKEN, when the scheduler has one, is passed on the
# same way (the environment): instances present it to register.
set -euo pipefail

usage="usage: atlas_node.sh preflight NPU_LIST | head | instances ROLES NPU_LIST"
what=${1:?$usage}
ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}

die() { echo "atlas_node.sh: $*" >&2; exit 1; }

# ---- CANN environment. set_env.sh reads variables that may be unset (e.g. `$PYTHONPATH` on some
# CANN versions), so it is sourced with `set -u` off. Paths: ascend-toolkit/set_env.sh (CANN
# <= 8.x), cann/set_env.sh (newer layout); nnal/atb/set_env.sh adds the ATB ops
# (_npu_paged_attention, _npu_reshape_and_cache).
load_ascend_env() {
  local f
  set +u
  for f in "${ASCEND_ENV:-}" "$ASCEND_HOME/ascend-toolkit/set_env.sh" "$ASCEND_HOME/cann/set_env.sh"; do
    # shellcheck source=/dev/null
    if [[ -n "$f" && -f "$f" ]]; then source "$f"; break; fi
  done
  # shellcheck source=/dev/null
  if [[ -f "$ASCEND_HOME/nnal/atb/set_env.sh" ]]; then source "$ASCEND_HOME/nnal/atb/set_env.sh"; fi
  set -u
}

# ---- Preflight: fail fast, one line per problem, before any process starts.
#   driver:  npu-smi ships with the driver; version from $ASCEND_HOME/driver/version.info
#            ("Version=..."; the file torch_npu.utils.get_cann_version("DRIVER") reads).
#   CANN:    "version=..." in <toolkit>/<arch>-linux/ascend_toolkit_install.info, where
#            <toolkit> is $ASCEND_TOOLKIT_HOME / $ASCEND_HOME_PATH as set_env.sh exports them.
#   HBM:     `npu-smi info -m` maps a logical device id (what ASCEND_RT_VISIBLE_DEVICES takes)
#            to "NPU ID" + "Chip ID" (two chips per card on A3); `npu-smi info -t usages -i N
#            -c C` gives "HBM Capacity(MB)" and "HBM Usage Rate(%)".
cann_version() {
  local root f
  for root in "${ASCEND_TOOLKIT_HOME:-}" "${ASCEND_HOME_PATH:-}"; do
    [[ -n "$root" && -d "$root" ]] || continue
    for f in "$root"/*/ascend_toolkit_install.info "$root"/ascend_toolkit_install.info; do
      if [[ -f "$f" ]]; then sed -n 's/^version=//p' "$f" | head -n1; return 0; fi
    done
  done
  return 1
}

free_hbm_mb() {  # free_hbm_mb LOGICAL_ID -> free MB on stdout, or nothing when unknown
  local logical=$1 npu chip
  read -r npu chip < <(npu-smi info -m 2>/dev/null |
    awk -v id="$logical" '$1 ~ /^[0-9]+$/ && $3 == id {print $1, $2; exit}') || true
  [[ -n "${npu:-}" ]] || return 0
  npu-smi info -t usages -i "$npu" -c "$chip" 2>/dev/null | awk -F: '
    /HBM Capacity\(MB\)/   {gsub(/ /, "", $2); cap = $2}
    /HBM Usage Rate\(%\)/  {gsub(/ /, "", $2); rate = $2}
    END {if (cap != "" && rate != "") printf "%d\n", cap * (100 - rate) / 100}'
}

preflight() {  # preflight NPU_LIST
  local npus=${1:?preflight needs a comma-separated NPU list, e.g. 0,1,2,3} dev free drv cann
  local need=${MIN_FREE_HBM_MB:-$(( ${KV_CACHE_MB:-16384} + 20480 ))}
  command -v npu-smi >/dev/null 2>&1 ||
    die "preflight: npu-smi not found on PATH: this is not an Atlas server, or the Ascend driver is not installed (npu-smi ships with it)"
  npu-smi info >/dev/null 2>&1 ||
    die "preflight: \`npu-smi info\` failed: the NPU driver is not loaded or this user cannot reach /dev/davinci* (run \`npu-smi info\` to see why)"
  drv=$(sed -n 's/^Version=//p' "$ASCEND_HOME/driver/version.info" 2>/dev/null | head -n1)
  [[ -n "$drv" ]] || die "preflight: no driver version in $ASCEND_HOME/driver/version.info (set ASCEND_HOME to the Ascend install root)"
  cann=$(cann_version) || die "preflight: CANN not found: source its set_env.sh or set ASCEND_ENV=/path/to/set_env.sh"
  echo "preflight: driver $drv, CANN $cann"
  IFS=, read -ra devs <<< "$npus"
  for dev in "${devs[@]}"; do
    [[ "$dev" =~ ^[0-9]+$ ]] || die "preflight: NPU list must be comma-separated ids without spaces, got '$npus'"
    free=$(free_hbm_mb "$dev")
    [[ -n "$free" ]] || die "preflight: NPU $dev not found by \`npu-smi info -m\` (or no HBM figures): check the id with \`npu-smi info -m\`"
    (( free >= need )) ||
      die "preflight: NPU $dev has ${free} MB free HBM, needs ${need} MB (MIN_FREE_HBM_MB): stop what runs there (\`npu-smi info\` lists processes) or lower KV_CACHE_MB"
    echo "preflight: NPU $dev ok, ${free} MB HBM free"
  done
}

# ---- HCCL / Gloo network (CANN env-var reference, HCCL chapter):
#   HCCL_IF_IP: host address HCCL uses to reach the root when a communicator is created from
#     root info (our P-D pairs: torch_npu exchanges root info through a TCPStore); it takes
#     priority over HCCL_SOCKET_IFNAME.
#   HCCL_SOCKET_IFNAME "=NIC": exact interface name (a bare "NIC" is a prefix match).
#   HCCL_HOST_SOCKET_PORT_RANGE: host ports HCCL listens on for root-info communicators ("auto"
#     lets the OS pick); plan at least as many ports as HCCL processes per NPU and open the
#     range between servers. HCCL_NPU_SOCKET_PORT_RANGE (device side, default 16666) is passed
#     through if you set it; if set, it must be set on every server of a pair.
#   CANN 8.x/9.0 docs list these variables for Atlas A3 and, among A2 machines, name 800T A2 /
#   900 A2 PoD / 200T A2 Box16; setting them on an 800I A2 is harmless.
#   RANK_TABLE_FILE: unset, so torch_npu never takes its rank-table path
#     (HCCLComm::createGlobalHcclComm -> HcclCommInitClusterInfoConfig) for a pair group.
network_env() {
  NODE_IP=${NODE_IP:-$(hostname -I | awk '{print $1}')}
  NIC=${NIC:-$(ip -o -4 addr show | awk -v ip="$NODE_IP" 'index($4, ip "/") == 1 {print $2; exit}')}
  [[ -n "$NODE_IP" ]] || die "cannot tell this server's address: set NODE_IP"
  [[ -n "$NIC" ]] || die "no interface holds $NODE_IP: set NIC (see \`ip -o -4 addr\`)"
  export HCCL_IF_IP=$NODE_IP
  export HCCL_SOCKET_IFNAME="=$NIC"
  export GLOO_SOCKET_IFNAME=$NIC
  export HCCL_HOST_SOCKET_PORT_RANGE=${HCCL_HOST_SOCKET_PORT_RANGE:-60000-60099}
  export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-120}
  export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-600}
  export P2P_HCCL_BUFFSIZE=${P2P_HCCL_BUFFSIZE:-20}   # MB per two-rank P2P communicator (one per P-D pair)
  export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
  export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-1}
  unset RANK_TABLE_FILE
}

pids=()
cleanup() {
  trap - EXIT INT TERM HUP
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait || true
}

case "$what" in
  preflight)
    load_ascend_env
    preflight "${2:-}"
    exit 0
    ;;
  head)
    MODEL=${MODEL:?set MODEL to the checkpoint directory (same path on every server)}
    network_env
    trap cleanup EXIT INT TERM HUP
    epdserve scheduler --model "$MODEL" --host 0.0.0.0 --port "${SCHED_PORT:-50051}" --mode "${MODE:-E-P-D}" &
    pids+=($!)
    echo "head: scheduler on $NODE_IP:${SCHED_PORT:-50051}"
    ;;
  instances)
    roles=${2:?instances needs ROLES (E, P, D, EP, ED, PD or EPD)}
    npus=${3:?instances needs a comma-separated NPU list, e.g. 0,1,2,3}
    MODEL=${MODEL:?set MODEL to the checkpoint directory (same path on every server)}
    HEAD_IP=${HEAD_IP:?set HEAD_IP to the scheduler server address}
    MM_STORE=${MM_STORE:?set MM_STORE to the cluster Redis URL, e.g. redis://:PASSWORD@host:6379/0}
    load_ascend_env
    preflight "$npus"
    network_env
    extra=()
    if [[ -n "${EXTRA_ARGS:-}" ]]; then read -ra extra <<< "$EXTRA_ARGS"; fi
    trap cleanup EXIT INT TERM HUP
    IFS=, read -ra devs <<< "$npus"
    for dev in "${devs[@]}"; do
      # One NPU per instance process: ASCEND_RT_VISIBLE_DEVICES takes logical ids (as
      # `npu-smi info -m` lists them); the process then sees its NPU as npu:0.
      ASCEND_RT_VISIBLE_DEVICES=$dev epdserve instance --roles "$roles" --model "$MODEL" --device npu \
        --scheduler "$HEAD_IP:${SCHED_PORT:-50051}" --mm-store "$MM_STORE" --host "$NODE_IP" --bind-host 0.0.0.0 \
        --kv-cache-mb "${KV_CACHE_MB:-16384}" "${extra[@]}" &
      pids+=($!)
    done
    echo "started ${#devs[@]} $roles instance(s) on NPUs $npus of $NODE_IP"
    ;;
  *)
    echo "$usage" >&2; exit 2 ;;
esac

wait -n || true   # the first process to exit (or a signal) stops the rest
