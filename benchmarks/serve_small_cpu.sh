#!/usr/bin/env bash
# The earlier serving comparison (docs/benchmarks.md, "Earlier serving runs"): the small demo model on a 2-core CPU,
# monolithic against the EPD modes, three workloads, then the per-stage profile used to explain it.
# About 20 minutes. OMP_WAIT_POLICY=PASSIVE for every process of every mode (see docs/benchmarks.md: without it,
# OpenMP's spinning threads make any oversubscribed process 5-20x slower on a shared CPU).
# Raw records go to $OUT (default ./bench-results, outside git); summarize them with benchmarks/summarize.py.
set -euo pipefail
OUT=$(mkdir -p "${OUT:-bench-results}" && cd "${OUT:-bench-results}" && pwd)
cd "$(dirname "$0")/.."
MODEL=${MODEL:-$(python -c 'from epdserve.bench.offline import default_model; print(default_model("qwen2_vl"))')}
export OMP_WAIT_POLICY=PASSIVE
python -m epdserve.entrypoints.cli bench serve --modes monolithic,E-PD,EP-D,E-P-D --model "$MODEL" \
  --workload image-heavy,mixed,text-heavy --request-rate preset --env OMP_WAIT_POLICY=PASSIVE \
  --slo-ttft-ms 3000 --slo-tpot-ms 100 \
  --slo-note "EPD-Serve's 2 s / 50 ms scaled to the small model on 2 shared cores: see docs/benchmarks.md" \
  --out "$OUT/serve-small-cpu.json" --no-progress
python -m epdserve.entrypoints.cli profile --model "$MODEL" --resolutions 160x90,320x180,480x270 \
  --prompt-lens 32,128,512 --batch-sizes 1,4,16 --repeats 3 --out "$OUT/profile-small-cpu.json"
