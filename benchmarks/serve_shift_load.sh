#!/usr/bin/env bash
# The "shift under load" run (docs/benchmarks.md): every fixed mode and auto on traffic whose shape and rate change
# mid-run (image-heavy at 1 req/s -> text-heavy at 4 req/s -> mixed at 2 req/s, 60 requests each), SLO
# TTFT <= 3 s / TPOT <= 100 ms, the small demo model, this machine otherwise idle. About 20 minutes
# on 2 cores. Auto starts from the planner's choice (profile given, so no profiling run) and its
# controller decides every second; its scheduler log (decisions, switches) goes to $OUT/shift-load-auto-logs.
# Raw records go to $OUT (default ./bench-results, outside git); the summary kept in git:
# python benchmarks/summarize.py $OUT/serve-shift-load-small-cpu.json
set -euo pipefail
OUT=$(mkdir -p "${OUT:-bench-results}" && cd "${OUT:-bench-results}" && pwd)
cd "$(dirname "$0")/.."
epdserve bench serve --modes monolithic,P-D,E-PD,EP-D,E-P-D,ED-P,auto --workload shift \
  --shift-phases image-heavy,text-heavy:4,mixed:2 --num-requests 180 --request-rate 1.0 \
  --slo-ttft-ms 3000 --slo-tpot-ms 100 --env OMP_WAIT_POLICY=PASSIVE --no-progress \
  --mode-arg "auto=--log-dir $OUT/shift-load-auto-logs --profile benchmarks/results/profile-small-cpu.json --scheduler-args '--controller-tick-s 1 --controller-dwell-s 10 --controller-cooldown-s 5'" \
  --out "$OUT/serve-shift-load-small-cpu.json"
