#!/usr/bin/env bash
# Run a command with CANN's environment: the Ascend image's entrypoint (deploy/docker/Dockerfile.ascend)
# and the command prefix of the `ascend` flavour's containers (epdserve/deploy/kube/flavours.py).
# Paths as scripts/atlas_node.sh's load_ascend_env: ascend-toolkit/set_env.sh (CANN <= 8.x),
# cann/set_env.sh (newer layout), then nnal/atb/set_env.sh (the ATB operators). set_env.sh reads
# variables that may be unset, so -u stays off.
set -eo pipefail
ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}
for f in "$ASCEND_HOME/ascend-toolkit/set_env.sh" "$ASCEND_HOME/cann/set_env.sh"; do
  # shellcheck source=/dev/null
  if [[ -f "$f" ]]; then source "$f"; break; fi
done
# shellcheck source=/dev/null
if [[ -f "$ASCEND_HOME/nnal/atb/set_env.sh" ]]; then source "$ASCEND_HOME/nnal/atb/set_env.sh"; fi
exec "$@"
