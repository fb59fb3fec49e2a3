#!/usr/bin/env bash
# What to run first on an Ascend server (an Atlas 800I A2) before serving: each step under its
# own timeout, one table at the end (step, status, detail), exit 1 if a step failed.
#
#   scripts/npu_first_run.sh [OUT_DIR]        # default ./npu-first-run: each step's rows and log
#
# Steps (epdserve/checks/npu/first_run.py says what each checks and against which source):
#   versions  driver / CANN / torch_npu against the table (epdserve/platform/npu_versions.py)
#   probe     the operator schemas, and one tiny attention call the CANN must answer rightly
#   matrix    head_dim 64/128 x bf16/fp16 x all-decode / decode+chunk / fresh prompt against the
#             portable ops in float32 (max error); fp16 must be refused
#   hccl      an HCCL pair, its ranks on NPUs 0 and 1 (both on 0, said, when one is visible): one
#             message, then the sender killed mid-receive
#   limits    core limits under the profiler (epdserve bench colocation --device npu)
#   graphs    decode graphs against eager, token for token, and their evidence (refused where
#             the torch_npu line lacks the graph-task API)
#   pd        a PD engine on the NPU against transformers, token for token (head_dim 128)
#
# Settings (environment):
#   PYTHON       the interpreter epdserve is installed in      [python3]
#   DEVICE       where tensors go                               [npu]
#   ASCEND_HOME  where CANN is installed                       [/usr/local/Ascend]
#   ASCEND_ENV   CANN's set_env.sh   [$ASCEND_HOME/ascend-toolkit/set_env.sh, else .../cann/set_env.sh]
#                then NNAL's $ASCEND_HOME/nnal/atb/set_env.sh where it exists: torch_npu 2.8 / 2.9 write the KV
#                cache with ATB's _npu_reshape_and_cache, which needs its libatb.so (atlas_node.sh does the same)
#   MODEL        pd, graphs: a checkpoint (default: the small demo model with head_dim 128, built into OUT_DIR)
#   ENV_ONLY     1: source the environment, print it, and stop (a check of the sourcing)
#   STEP_TIMEOUT_S  one timeout for every step, in seconds (default: per step, below)
set -euo pipefail

PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-npu}
OUT=${1:-./npu-first-run}
mkdir -p "$OUT"

die() { echo "npu_first_run.sh: $*" >&2; exit 2; }
command -v timeout >/dev/null 2>&1 || die "timeout (coreutils) not found"
"$PYTHON" -c 'import epdserve' 2>/dev/null || die "$PYTHON cannot import epdserve: set PYTHON to the interpreter it is installed in"

# CANN's set_env.sh reads unset variables on some versions: sourced with `set -u` off.
ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}
if [[ "$DEVICE" == npu ]]; then
  for f in "${ASCEND_ENV:-}" "$ASCEND_HOME/ascend-toolkit/set_env.sh" "$ASCEND_HOME/cann/set_env.sh"; do
    if [[ -n "$f" && -f "$f" ]]; then
      set +u
      # shellcheck disable=SC1090
      source "$f"
      set -u
      break
    fi
  done
  if [[ -f "$ASCEND_HOME/nnal/atb/set_env.sh" ]]; then
    set +u
    # shellcheck disable=SC1091
    source "$ASCEND_HOME/nnal/atb/set_env.sh"
    set -u
  fi
fi
if [[ "${ENV_ONLY:-0}" == 1 ]]; then
  env
  exit 0
fi

declare -A LIMIT=([versions]=120 [probe]=300 [matrix]=900 [hccl]=300 [limits]=1800 [graphs]=1800 [pd]=1800)
STEPS=(versions probe matrix hccl limits graphs pd)
failed=0
rows="$OUT/table.tsv"
: > "$rows"
for step in "${STEPS[@]}"; do
  t=${STEP_TIMEOUT_S:-${LIMIT[$step]}}
  echo "npu_first_run.sh: $step (timeout $t s) ..." >&2
  rc=0
  timeout -k 10 "$t" "$PYTHON" -m epdserve.checks.npu.first_run "$step" --device "$DEVICE" --out-dir "$OUT" \
    --model "${MODEL:-}" > "$OUT/$step.tsv" 2> "$OUT/$step.log" || rc=$?
  cat "$OUT/$step.tsv" >> "$rows"
  if (( rc == 124 || rc == 137 )); then
    printf '%s\tfail\ttimed out after %s s (log: %s)\n' "$step" "$t" "$OUT/$step.log" >> "$rows"
    failed=1
  elif (( rc != 0 )); then
    if ! grep -q $'\tfail\t' "$OUT/$step.tsv"; then
      printf '%s\tfail\texit %s: %s (log: %s)\n' "$step" "$rc" "$(tail -n 1 "$OUT/$step.log")" "$OUT/$step.log" >> "$rows"
    fi
    failed=1
  fi
done

awk -F'\t' '{ if (length($1) > w) w = length($1) } { r[NR] = $0 }
  END { fmt = "%-" w "s  %-7s  %s\n"; printf fmt, "step", "status", "detail"
        for (i = 1; i <= NR; i++) { split(r[i], f, "\t"); printf fmt, f[1], f[2], f[3] } }' "$rows"
exit "$failed"
