#!/usr/bin/env bash
# Start epdserve processes on ONE Atlas 800I A2 / A3 server (Ascend NPUs), in the foreground.
#
#   scripts/atlas_node.sh preflight 0,1,2,3         # check this server only (driver, CANN, HBM for MODEL)
#   scripts/atlas_node.sh head                      # the scheduler (no NPU needed)
#   scripts/atlas_node.sh instances E  0            # one E instance on NPU 0
#   scripts/atlas_node.sh instances P  0,1,2,3      # one P instance per NPU
#   scripts/atlas_node.sh instances EP 4,5          # co-located E+P per NPU (stream core limits)
#   scripts/atlas_node.sh instances D  6,7
#   scripts/atlas_node.sh new-env                   # write a fresh env file (random token + API key)
#   scripts/atlas_node.sh check-env [head]          # check the env file (and MM_STORE) as `head` / `instances` do
#
# `instances` runs the preflight first and stops with one line saying what is missing.
# Every process started here is stopped when this script gets Ctrl-C / SIGTERM / SIGHUP (the
# ssh session closing), and `epdserve instance` deregisters on the way out.
#
# Secrets never ride a command line (`ps` shows every argv to every user of the server): they
# live in an env file, mode 0600 and owned by you, that `head` and `instances` source (`set -a`)
# before starting anything and refuse to run without:
#   EPDSERVE_CLUSTER_TOKEN      instances present it to register, the scheduler to call them   [required]
#   EPDSERVE_API_KEY            clients send it as `authorization: Bearer` to the scheduler    [required on the head]
#                               (`instances` drops it before starting anything: an instance never needs it)
#   EPDSERVE_MM_STORE_PASSWORD  (and EPDSERVE_MM_STORE_USERNAME for an ACL user) of the MM Store's Redis
#   EPDSERVE_MEDIA_KEY_SECRET   the scheduler keys media with it (unset: a random one per scheduler start)
# `new-env` writes one with a random token and key; atlas_cluster_example.sh copies it to every
# server over ssh's stdin. The scheduler serves clients on NODE_IP:SCHED_PORT and the instance
# registry on NODE_IP:REG_PORT; instances bind NODE_IP only. Open both ports, the instances' and
# HCCL's only between the cluster's servers.
#
# Settings (environment; defaults in brackets):
#   MODEL            checkpoint directory, same path on every server          [required]
#   HEAD_IP          address of the scheduler's server                        [required for instances]
#   MM_STORE         MM Store URL of a Redis the cluster already runs, WITHOUT a password, e.g.
#                    rediss://redis.example:6380/0 (TLS) or redis://10.0.0.5:6379/0;
#                    the password goes in the env file                        [required for instances]
#   EPDSERVE_ENV_FILE  the env file above                                     [$HOME/.epdserve/env]
#   INSECURE         1: a closed lab only: no env file needed, epdserve runs with --insecure (no API
#                    key or cluster token checked); warns on every start       [0]
#   DEVICE           npu, or cpu: a try-out on any machine (no preflight, no CANN environment,
#                    `--device cpu`; each id in the NPU list starts one CPU instance), e.g. the
#                    whole configuration on loopback with NODE_IP=HEAD_IP=127.0.0.1 NIC=lo    [npu]
#   NODE_IP          this server's address on the cluster / HCCL network: every port binds it;
#                    never guessed (the first `hostname -I` address may be a public one)  [required]
#   NIC              network interface of NODE_IP (HCCL/GLOO socket ifname)   [found from NODE_IP]
#   SCHED_PORT       scheduler's public port (clients)                        [50051]
#   REG_PORT         scheduler's internal port (instance registry)            [50052]
#   MODE             mode name reported by the scheduler                      [E-P-D]
#   ROLES            `preflight` only: the roles to size HBM for (`instances` takes them as argument)  [P]
#   TENSOR_PARALLEL_SIZE  NPUs per instance (an instance at --tensor-parallel-size N holds 1/N of the
#                    weights on each of N NPUs): the NPU list must split into groups of N, each NPU is
#                    sized for its share, and `instances` starts one instance per group, with
#                    --tensor-parallel-size N and the group in ASCEND_RT_VISIBLE_DEVICES; PD and EPD
#                    instances take it, and every other role unless its own is set below        [1]
#   ENCODE_TENSOR_PARALLEL_SIZE   the same for E instances          [unset or 0: TENSOR_PARALLEL_SIZE]
#   PREFILL_TENSOR_PARALLEL_SIZE  the same for P, EP, P+E instances [unset or 0: TENSOR_PARALLEL_SIZE]
#   DECODE_TENSOR_PARALLEL_SIZE   the same for D, ED instances      [unset or 0: TENSOR_PARALLEL_SIZE]
#                    (`epdserve launch --prefill-tensor-parallel-size`...); the P->D KV hop carries
#                    every pair of degrees (each D rank gets its own KV heads): set each the same on
#                    every server, e.g. on one 800I A2: ENCODE_...=1 for E on 0,1, PREFILL_...=2 for P on
#                    2,3, DECODE_...=4 for D on 4,5,6,7 (docs/tensor-parallel.md)
#   KV_CACHE_MB      KV cache per P/D worker   [on NPU: what the preflight finds fits, at most 16384; with DEVICE=cpu the instance's default]
#   HBM_MARGIN_MB    preflight: HBM each process needs beyond weights and KV cache (activations,
#                    CANN/ATB workspaces, HCCL buffers, the runtime's context); an estimate, not a
#                    measurement: raise it if an instance runs out of device memory   [4096]
#   MIN_FREE_HBM_MB  preflight: a fixed free-HBM figure each NPU must have, instead of the sizing
#                    below                                                    [unset]
#   HCCL_HOST_SOCKET_PORT_RANGE  host ports HCCL may use (open them between servers); passed on
#                    only if you set it: see "HCCL / Gloo network" below      [unset]
#   EXTRA_ARGS       extra `epdserve instance` flags, split on spaces; no secrets here  []
#   ASCEND_ENV       CANN set_env.sh   [/usr/local/Ascend/ascend-toolkit/set_env.sh, else .../cann/set_env.sh]
#   ASCEND_HOME      Ascend install root (driver/version.info)                [/usr/local/Ascend]
#
# The MM Store's Redis is NOT started here: point MM_STORE at the cluster's own Redis, which
# should require a password or an ACL user (or TLS) and listen only on the cluster network.
set -euo pipefail

usage="usage: atlas_node.sh preflight NPU_LIST | head | instances ROLES NPU_LIST | new-env | check-env [head]"
what=${1:?$usage}
ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}
DEVICE=${DEVICE:-npu}
ENV_FILE=${EPDSERVE_ENV_FILE:-$HOME/.epdserve/env}

die() { echo "atlas_node.sh: $*" >&2; exit 1; }

case "$DEVICE" in npu|cpu) ;; *) die "DEVICE must be npu or cpu, got '$DEVICE'" ;; esac

# ---- Secrets: the env file. Checked as ssh checks a private key: a regular file, owned by this
# user, no access for group or others; then sourced with `set -a` so epdserve inherits it.
check_env_file() {
  local owner mode
  [[ -e "$ENV_FILE" ]] ||
    die "no env file $ENV_FILE: write one with \`atlas_node.sh new-env\` (or set EPDSERVE_ENV_FILE); INSECURE=1 runs without, in a closed lab only"
  [[ -f "$ENV_FILE" ]] || die "env file $ENV_FILE is not a regular file: point EPDSERVE_ENV_FILE at the file itself"
  read -r owner mode < <(stat -L -c '%u %a' "$ENV_FILE")
  [[ "$owner" == "$(id -u)" ]] ||
    die "env file $ENV_FILE is not owned by $(id -un): copy it to a file of your own (\`install -m 600 SRC DEST\`) and set EPDSERVE_ENV_FILE"
  (( (8#$mode & 8#077) == 0 )) ||
    die "env file $ENV_FILE has mode $mode, readable or writable by others: chmod 600 $ENV_FILE (and replace the secrets in it if others may have read them)"
}

load_env_file() {  # load_env_file [head]: the secrets into the environment, or a one-line refusal
  if [[ "${INSECURE:-0}" == 1 ]]; then
    insecure=(--insecure)
    echo "atlas_node.sh: WARNING: INSECURE=1: epdserve runs with --insecure, no API key or cluster token guards this server's ports: a closed lab network only" >&2
    [[ -e "$ENV_FILE" ]] || return 0
  fi
  check_env_file
  set -a
  # shellcheck source=/dev/null
  source "$ENV_FILE"
  set +a
  [[ "${INSECURE:-0}" == 1 ]] && return 0
  [[ -n "${EPDSERVE_CLUSTER_TOKEN:-}" ]] ||
    die "env file $ENV_FILE sets no EPDSERVE_CLUSTER_TOKEN: add one (the same on every server; \`atlas_node.sh new-env\` writes a random one)"
  [[ "${1:-}" != head || -n "${EPDSERVE_API_KEY:-}" ]] ||
    die "env file $ENV_FILE sets no EPDSERVE_API_KEY, which the head needs (clients send it): add one (\`atlas_node.sh new-env\` writes a random one)"
  return 0
}

check_mm_store() {  # a password in MM_STORE would be an `epdserve instance` argument, seen in `ps`
  local rest=${MM_STORE#*://} userinfo="" query='[?&]password='
  rest=${rest%%[/?#]*}
  if [[ "$rest" == *@* ]]; then userinfo=${rest%@*}; fi
  if [[ "$userinfo" == *:?* || "$MM_STORE" =~ $query ]]; then
    die "MM_STORE carries a password, which \`ps\` would show: put EPDSERVE_MM_STORE_PASSWORD=... (and EPDSERVE_MM_STORE_USERNAME=...) in $ENV_FILE and leave it out of the URL"
  fi
}

new_env() {  # a fresh env file with a random cluster token, API key and media-key secret; never overwrites one
  [[ ! -e "$ENV_FILE" ]] || die "$ENV_FILE exists: remove it first to replace its secrets (every server and client then needs the new file)"
  ( umask 077; set -o noclobber
    mkdir -p "$(dirname "$ENV_FILE")"
    {
      echo "# epdserve secrets: mode 0600, the same file on every server of the deployment"
      echo "EPDSERVE_CLUSTER_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"
      echo "EPDSERVE_API_KEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"
      echo "EPDSERVE_MEDIA_KEY_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"
      echo "# the MM Store Redis's password (and ACL user), if it has one:"
      echo "#EPDSERVE_MM_STORE_PASSWORD="
      echo "#EPDSERVE_MM_STORE_USERNAME="
    } > "$ENV_FILE" )
  echo "wrote $ENV_FILE (mode 0600): a random EPDSERVE_CLUSTER_TOKEN, EPDSERVE_API_KEY and EPDSERVE_MEDIA_KEY_SECRET; clients send the API key"
}

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
#            -c C` gives "HBM Capacity(MB)" (the device's total) and "HBM Usage Rate(%)".
#            Each instance process needs weights + KV cache + HBM_MARGIN_MB:
#              weights: the sizes of MODEL's *.safetensors, scaled from the dtype config.json
#                names to the one the instance loads (bf16 on an NPU unless EXTRA_ARGS says
#                `--dtype float32`: epdserve/engine/loaded_model.py load_model); every role loads
#                the whole checkpoint (one LoadedModel per process);
#              KV cache: KV_CACHE_MB for every role but E (an E-only engine holds 8 MiB:
#                epdserve/instance/host.py _E_KV_BYTES); unset, the largest that fits in the
#                NPU's free HBM, at most 16384 MB, at least 1024 MB.
#            The need must fit the device's total HBM (else the model does not fit this product,
#            e.g. the Atlas 800I A2 32 GB variant) and its free HBM (else something else uses it).
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

weights_mb() {  # weights_mb MODEL -> MB the checkpoint's weights take on the device (0 without MODEL)
  local model=${1:-} bytes=0 f size disk=2 dev=2 dtype
  [[ -n "$model" && -d "$model" ]] || { echo 0; return 0; }
  for f in "$model"/*.safetensors; do
    if [[ -f "$f" ]]; then size=$(stat -L -c %s "$f"); bytes=$(( bytes + size )); fi
  done
  dtype=$(grep -o '"\(torch_\)\{0,1\}dtype"[[:space:]]*:[[:space:]]*"[a-z0-9]*"' "$model/config.json" 2>/dev/null |
    head -n1 | sed 's/.*"\([a-z0-9]*\)"$/\1/') || true
  if [[ "$dtype" == float32 ]]; then disk=4; fi
  if [[ "${EXTRA_ARGS:-}" =~ --dtype[=\ ]+float32 ]]; then dev=4; fi
  echo $(( (bytes * dev / disk + 1048575) / 1048576 ))
}

hbm_mb() {  # hbm_mb LOGICAL_ID -> "TOTAL FREE" MB on stdout, or "unknown WHY" (not-mapped, unavailable, no-hbm, no-figures)
  # Ascend's npu-smi manual, "查询所有芯片映射关系信息" (npu-smi info -m; hiascend.com document/detail/
  # zh/Atlas%20200I%20A2/2520/re/npu/npusmi_013.html): columns NPU ID, Chip ID, Chip Logic ID, Chip
  # Name; an NPU ID of -1 marks an NPU that is not available. "查询指定芯片统计信息" (npu-smi info -t
  # usages -i id -c chip_id; .../npusmi_020.html): a product without HBM prints "Memory Capacity(MB)"
  # / "Memory Usage Rate(%)". HBM products print "HBM Capacity(MB)" / "HBM Usage Rate(%)" (an
  # integer percentage, so the free figure is good to 1 % of the total): the spelling of Ascend's
  # Atlas 350 manual for the same command and of 910B hosts' output (telegraf's npu_smi input
  # fixtures); no Ascend page for the 800I A2's usages output was found.
  local logical=$1 npu chip
  read -r npu chip < <(npu-smi info -m 2>/dev/null |
    awk -v id="$logical" '$1 ~ /^-?[0-9]+$/ && $3 == id {print $1, $2; exit}') || true
  if [[ -z "${npu:-}" ]]; then echo "unknown not-mapped"; return 0; fi
  if [[ "$npu" == -1 ]]; then echo "unknown unavailable"; return 0; fi
  npu-smi info -t usages -i "$npu" -c "$chip" 2>/dev/null | awk -F: '
    /HBM Capacity\(MB\)/    {gsub(/ /, "", $2); cap = $2}
    /HBM Usage Rate\(%\)/   {gsub(/ /, "", $2); rate = $2}
    /Memory Capacity\(MB\)/ {mem = 1}
    END {
      if (cap != "" && rate != "") printf "%d %d\n", cap, cap * (100 - rate) / 100
      else if (mem) print "unknown no-hbm"
      else print "unknown no-figures"
    }'
}

# Versions: torch_npu against CANN and the driver, by the table of epdserve/platform/npu_versions.py
# (Ascend/pytorch COMPATIBILITY.en.md; torch_npu's own driver gates), with the python that runs
# epdserve (PYTHON, default python3). A failure stops the preflight with the fix in one line.
check_versions() {  # check_versions DRIVER CANN
  local py=${PYTHON:-python3} tnpu out line
  if ! "$py" -c 'import epdserve.platform.npu_versions' >/dev/null 2>&1; then
    echo "preflight: $py cannot import epdserve: torch_npu not checked against CANN (set PYTHON)" >&2
    return 0
  fi
  tnpu=$("$py" -c 'import importlib.metadata as m; print(m.version("torch_npu"))' 2>/dev/null) || tnpu=""
  [[ -n "$tnpu" ]] || echo "preflight: torch_npu not installed for $py (pip install epdserve[npu]; README's Ascend table)" >&2
  if ! out=$("$py" -m epdserve.platform.npu_versions --torch-npu "$tnpu" --cann "$2" --driver "$1"); then
    die "preflight: $(grep '^fail: ' <<< "$out" | head -n1)"
  fi
  while IFS= read -r line; do
    if [[ -n "$line" ]]; then echo "preflight: $line"; fi
  done <<< "$out"
}

# ---- Tensor-parallel degrees: each role its own (E, prefill-only, decode-only), else TENSOR_PARALLEL_SIZE.
role_degree() {  # role_degree ROLES: sets tp (the degree of ROLES' instances) and tp_var (the setting it came from)
  local own=""
  case "$1" in
    E) own=ENCODE_TENSOR_PARALLEL_SIZE ;;
    P|EP|P+E) own=PREFILL_TENSOR_PARALLEL_SIZE ;;
    D|ED) own=DECODE_TENSOR_PARALLEL_SIZE ;;
  esac
  tp=${TENSOR_PARALLEL_SIZE:-1} tp_var=TENSOR_PARALLEL_SIZE
  if [[ -n "$own" && -n "${!own:-}" && "${!own}" != 0 ]]; then tp=${!own} tp_var=$own; fi
  [[ "$tp" =~ ^[1-9][0-9]*$ ]] || die "$tp_var must be a positive integer, got '$tp'"
}

kv_fit_mb=""   # set by preflight: the KV cache (MB) each listed NPU has room for, when KV_CACHE_MB is unset
preflight() {  # preflight NPU_LIST [ROLES]
  local npus=${1:?preflight needs a comma-separated NPU list, e.g. 0,1,2,3} roles=${2:-P} dev total free drv cann
  local margin=${HBM_MARGIN_MB:-4096} weights kv room need floor
  command -v npu-smi >/dev/null 2>&1 ||
    die "preflight: npu-smi not found on PATH: this is not an Atlas server, or the Ascend driver is not installed (npu-smi ships with it)"
  npu-smi info >/dev/null 2>&1 ||
    die "preflight: \`npu-smi info\` failed: the NPU driver is not loaded or this user cannot reach /dev/davinci* (run \`npu-smi info\` to see why)"
  drv=$(sed -n 's/^Version=//p' "$ASCEND_HOME/driver/version.info" 2>/dev/null | head -n1)
  [[ -n "$drv" ]] || die "preflight: no driver version in $ASCEND_HOME/driver/version.info (set ASCEND_HOME to the Ascend install root)"
  cann=$(cann_version) || die "preflight: CANN not found: source its set_env.sh or set ASCEND_ENV=/path/to/set_env.sh"
  echo "preflight: driver $drv, CANN $cann"
  check_versions "$drv" "$cann"
  local tp tp_var
  role_degree "$roles"
  weights=$(weights_mb "${MODEL:-}")
  weights=$(( (weights + tp - 1) / tp ))  # each rank's share (the replicated embedding and vision tower are in the margin)
  if [[ -z "${MODEL:-}" ]]; then echo "preflight: MODEL unset: the HBM need counts KV cache and margin only" >&2; fi
  IFS=, read -ra devs <<< "$npus"
  (( ${#devs[@]} % tp == 0 )) ||
    die "preflight: $tp_var=$tp needs the NPU list in groups of $tp, got ${#devs[@]} NPU(s) ($npus)"
  if (( tp > 1 )); then echo "preflight: ${#devs[@]} NPU(s), $(( ${#devs[@]} / tp )) instance(s) of $tp; ${weights} MB of weights per NPU"; fi
  for dev in "${devs[@]}"; do
    [[ "$dev" =~ ^[0-9]+$ ]] || die "preflight: NPU list must be comma-separated ids without spaces, got '$npus'"
    total="" free=""
    read -r total free < <(hbm_mb "$dev") || true
    if [[ "$total" == unknown || -z "$free" ]]; then
      case "$free" in
        unavailable) die "preflight: NPU $dev: \`npu-smi info -m\` shows NPU ID -1 for it (npu-smi's manual: the NPU is not available): check \`npu-smi info\` (Health) and the driver's log" ;;
        no-hbm) die "preflight: NPU $dev: \`npu-smi info -t usages\` shows Memory Capacity(MB) but no HBM figures: a product without HBM; this preflight sizes HBM products (Atlas 800I A2, A3) only" ;;
        no-figures) die "preflight: NPU $dev: \`npu-smi info -t usages\` printed no HBM Capacity(MB) / HBM Usage Rate(%): run it by hand to see why" ;;
        *) die "preflight: NPU $dev not found by \`npu-smi info -m\` (no row with that Chip Logic ID): check the id with \`npu-smi info -m\`" ;;
      esac
    fi
    if [[ -n "${MIN_FREE_HBM_MB:-}" ]]; then
      (( free >= MIN_FREE_HBM_MB )) ||
        die "preflight: NPU $dev has ${free} MB free HBM, needs ${MIN_FREE_HBM_MB} MB (MIN_FREE_HBM_MB): stop what runs there (\`npu-smi info\` lists processes) or lower it"
      echo "preflight: NPU $dev ok, ${free} MB HBM free"
      continue
    fi
    room=$(( free - weights - margin ))
    if [[ "$roles" == E ]]; then kv=0
    elif [[ -n "${KV_CACHE_MB:-}" ]]; then kv=$KV_CACHE_MB
    else kv=$(( room < 1024 ? 1024 : room < 16384 ? room : 16384 )); fi
    need=$(( weights + kv + margin ))
    floor=$(( kv < 1024 ? kv : 1024 ))   # the least KV cache a P/D instance starts with
    (( weights + floor + margin <= total )) ||
      die "preflight: NPU $dev has ${total} MB HBM in all; this instance needs at least $(( weights + floor + margin )) MB (${weights} weights + ${floor} KV cache + ${margin} margin): the model does not fit this device"
    (( need <= free )) ||
      die "preflight: NPU $dev has ${free} MB of ${total} MB HBM free; this instance needs ${need} MB (${weights} weights + ${kv} KV cache + ${margin} margin): $( (( room >= 1024 )) && [[ "$roles" != E ]] && echo "lower KV_CACHE_MB to at most ${room}, or " )stop what runs there (\`npu-smi info\` lists processes)"
    if [[ "$roles" != E && -z "${KV_CACHE_MB:-}" ]] && [[ -z "$kv_fit_mb" || "$kv" -lt "$kv_fit_mb" ]]; then kv_fit_mb=$kv; fi
    echo "preflight: NPU $dev ok, ${free} MB of ${total} MB HBM free; needs ${need} MB (${weights} weights + ${kv} KV cache + ${margin} margin)"
  done
}

# ---- HCCL / Gloo network (CANN env-var reference, HCCL chapter):
#   HCCL_IF_IP: host address HCCL uses to reach the root when a communicator is created from
#     root info (our P-D pairs: torch_npu exchanges root info through a TCPStore); it takes
#     priority over HCCL_SOCKET_IFNAME.
#   HCCL_SOCKET_IFNAME "=NIC": exact interface name (a bare "NIC" is a prefix match).
#   HCCL_HOST_SOCKET_PORT_RANGE: host ports HCCL listens on for root-info communicators ("auto"
#     lets the OS pick); plan at least as many ports as HCCL processes per NPU and open the
#     range between servers. CANN documents it only for Atlas A3 and, among A2 machines, for the
#     Atlas 800T A2, 900 A2 PoD and 200T A2 Box16 ("Supported models" on its page:
#     CANN 9.0.0 HCCL user guide hcclenvref_07_0020, CANN env-var reference envref_07_0143) — not
#     for the 800I A2 this script mostly runs on, nor with MC2 fused operators on A2. So it is
#     opt-in: exported only when you set it (on a documented product); otherwise HCCL picks its
#     host port as it does by default (HCCL_IF_BASE_PORT). HCCL_NPU_SOCKET_PORT_RANGE (device
#     side) is likewise passed through only if you set it; if set, on every server of a pair.
#   HCCL_EXEC_TIMEOUT: 600 s unless set, and refused unless a positive whole number. After a
#     stalled pair's teardown a receive may run on (HcclCommDestroy returns E_AGAIN, ignored by
#     torch_npu) until this timeout, so the decode side holds its blocks until then + 30 s; 0 is
#     "never time out" (torch_npu ProcessGroupHCCL.cpp; strtol reads "0.5" or "abc" as 0), which
#     would hold them for ever. 600 s bounds that at 10.5 min instead of the default 1836 s, and is
#     still far above any one KV transfer (its own deadline is KVTransferConfig.timeout_s).
#   RANK_TABLE_FILE: unset, so torch_npu never takes its rank-table path
#     (HCCLComm::createGlobalHcclComm -> HcclCommInitClusterInfoConfig) for a pair group.
network_env() {
  [[ -n "${NODE_IP:-}" ]] ||
    die "set NODE_IP to this server's address on the cluster network (every port binds it; see \`ip -o -4 addr\`): it is never guessed, the first address of \`hostname -I\` may be a public one"
  NIC=${NIC:-$(ip -o -4 addr show | awk -v ip="$NODE_IP" 'index($4, ip "/") == 1 {print $2; exit}')}
  [[ -n "$NIC" ]] || die "no interface holds $NODE_IP: set NIC (see \`ip -o -4 addr\`)"
  export HCCL_IF_IP=$NODE_IP
  export HCCL_SOCKET_IFNAME="=$NIC"
  export GLOO_SOCKET_IFNAME=$NIC
  if [[ -n "${HCCL_HOST_SOCKET_PORT_RANGE:-}" ]]; then
    export HCCL_HOST_SOCKET_PORT_RANGE
    echo "atlas_node.sh: HCCL_HOST_SOCKET_PORT_RANGE=$HCCL_HOST_SOCKET_PORT_RANGE (CANN documents it for Atlas A3, 800T A2, 900 A2 PoD and 200T A2 Box16 only)" >&2
  fi
  export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-120}
  export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-600}
  [[ "$HCCL_EXEC_TIMEOUT" =~ ^[0-9]+$ && "$HCCL_EXEC_TIMEOUT" -gt 0 ]] ||
    die "HCCL_EXEC_TIMEOUT=$HCCL_EXEC_TIMEOUT: HCCL would never time out a stuck KV receive, whose blocks epdserve then never reuses; set a positive whole number of seconds (default 600)"
  export P2P_HCCL_BUFFSIZE=${P2P_HCCL_BUFFSIZE:-20}   # MB per two-rank P2P communicator (one per P-D pair)
  export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
  export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-1}
  unset RANK_TABLE_FILE
}

pids=()
insecure=()
cleanup() {
  trap - EXIT INT TERM HUP
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait || true
}

case "$what" in
  preflight)
    if [[ "$DEVICE" == cpu ]]; then echo "preflight: DEVICE=cpu, nothing to check"; exit 0; fi
    load_ascend_env
    preflight "${2:-}" "${ROLES:-P}"
    exit 0
    ;;
  new-env)
    new_env
    exit 0
    ;;
  check-env)
    if [[ -n "${MM_STORE:-}" ]]; then check_mm_store; fi
    load_env_file "${2:-}"
    if [[ -e "$ENV_FILE" ]]; then echo "env file $ENV_FILE: ok"; else echo "no env file $ENV_FILE (INSECURE=1)"; fi
    exit 0
    ;;
  head)
    MODEL=${MODEL:?set MODEL to the checkpoint directory (same path on every server)}
    load_env_file head
    network_env
    trap cleanup EXIT INT TERM HUP
    # Clients on SCHED_PORT (API key), the instance registry on REG_PORT (cluster token), both
    # on the cluster interface only; the key and token come from the environment (the env file).
    epdserve scheduler --model "$MODEL" --host "$NODE_IP" --port "${SCHED_PORT:-50051}" \
      --internal-host "$NODE_IP" --internal-port "${REG_PORT:-50052}" --mode "${MODE:-E-P-D}" "${insecure[@]}" &
    pids+=($!)
    echo "head: scheduler on $NODE_IP:${SCHED_PORT:-50051}, instance registry on $NODE_IP:${REG_PORT:-50052}"
    ;;
  instances)
    roles=${2:?instances needs ROLES (E, P, D, EP, ED, PD or EPD)}
    npus=${3:?instances needs a comma-separated NPU list, e.g. 0,1,2,3}
    # each stage its own degree (role_degree: ENCODE_/PREFILL_/DECODE_TENSOR_PARALLEL_SIZE, else
    # TENSOR_PARALLEL_SIZE); the KV hop carries any pair of P and D degrees
    role_degree "$roles"
    MODEL=${MODEL:?set MODEL to the checkpoint directory (same path on every server)}
    HEAD_IP=${HEAD_IP:?set HEAD_IP to the scheduler server address}
    MM_STORE=${MM_STORE:?set MM_STORE to the cluster Redis URL, e.g. redis://10.0.0.5:6379/0 (its password in the env file)}
    check_mm_store
    load_env_file
    unset EPDSERVE_API_KEY   # clients' key: no instance needs it, so none holds it
    if [[ "$DEVICE" == npu ]]; then
      load_ascend_env
      preflight "$npus" "$roles"
    fi
    network_env
    extra=()
    if [[ -n "${EXTRA_ARGS:-}" ]]; then read -ra extra <<< "$EXTRA_ARGS"; fi
    kv_default=${kv_fit_mb:-16384}   # on NPU: what the preflight found fits every listed NPU
    kv_args=(--kv-cache-mb "${KV_CACHE_MB:-$kv_default}")
    if [[ "$DEVICE" == cpu && -z "${KV_CACHE_MB:-}" ]]; then kv_args=(); fi   # CPU: the instance's own default
    trap cleanup EXIT INT TERM HUP
    IFS=, read -ra devs <<< "$npus"
    role_degree "$roles"
    (( ${#devs[@]} % tp == 0 )) || die "instances: $tp_var=$tp needs the NPU list in groups of $tp, got $npus"
    tp_args=()
    if (( tp > 1 )); then tp_args=(--tensor-parallel-size "$tp"); fi
    for ((i = 0; i < ${#devs[@]}; i += tp)); do
      group=$(IFS=,; echo "${devs[*]:i:tp}")
      # One group of $tp NPUs per instance process (the role's degree; one NPU by default):
      # ASCEND_RT_VISIBLE_DEVICES takes logical ids (as `npu-smi info -m` lists them); the process
      # then sees its NPUs as npu:0.. (rank r on npu:r). Each binds the cluster interface only and
      # registers on the head's internal port with the cluster token.
      ASCEND_RT_VISIBLE_DEVICES=$group epdserve instance --roles "$roles" --model "$MODEL" --device "$DEVICE" \
        --scheduler "$HEAD_IP:${REG_PORT:-50052}" --mm-store "$MM_STORE" --host "$NODE_IP" \
        "${kv_args[@]}" "${tp_args[@]}" "${insecure[@]}" "${extra[@]}" &
      pids+=($!)
    done
    echo "started $(( ${#devs[@]} / tp )) $roles instance(s) on $NODE_IP ($DEVICE $npus, $tp NPU(s) each)"
    ;;
  *)
    echo "$usage" >&2; exit 2 ;;
esac

wait -n || true   # the first process to exit (or a signal) stops the rest
