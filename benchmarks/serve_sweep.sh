#!/usr/bin/env bash
# The full serving sweep of the README's "Serving: every mode, three workloads, two rates" table:
# every mode against monolithic, 40 requests per cell, two rates per workload, SLO TTFT <= 3 s /
# TPOT <= 100 ms, the small demo model, this machine otherwise idle. About 45 minutes on 2 cores.
# Each cell's ratio to monolithic comes with a 95% bootstrap interval (bench/spread.py).
# Raw records (every request) go to $OUT (default ./bench-results, outside git); the summaries kept in
# git are made from them: python benchmarks/summarize.py $OUT/sweep-mixed-split.json --plots
set -euo pipefail
OUT=$(mkdir -p "${OUT:-bench-results}" && cd "${OUT:-bench-results}" && pwd)
cd "$(dirname "$0")/.."
POLICY=${POLICY:-split}
COMMON=(--modes monolithic,P-D,E-PD,EP-D,ED-P,E-P-D --num-requests 40 --slo-ttft-ms 3000 --slo-tpot-ms 100
        --env OMP_WAIT_POLICY=PASSIVE --launch-arg "--colocation $POLICY" --no-progress)
epdserve bench serve "${COMMON[@]}" --workload image-heavy --request-rate 0.5,1.0 --out "$OUT/sweep-image-heavy-$POLICY.json"
epdserve bench serve "${COMMON[@]}" --workload mixed --request-rate 1.0,2.0 --out "$OUT/sweep-mixed-$POLICY.json"
epdserve bench serve "${COMMON[@]}" --workload text-heavy --request-rate 0.5,1.0 --out "$OUT/sweep-text-heavy-$POLICY.json"
