"""The multi-turn comparison (prefix cache and routing), one command:

    OMP_WAIT_POLICY=PASSIVE python benchmarks/multiturn.py --out bench-results/multiturn-prefix-cache.json

8 conversations of 4 turns over 1-2 images each (re-sent every turn), 24-token answers, 2 s think
time, conversations starting Poisson at 0.25/s, the small demo Qwen2-VL; back to back: monolithic
with the prefix cache on / off, P-D on / off, and 2 P instances with cache-aware / least-load
routing, 3 repeats of each; prints turns >= 2 TTFT p50 and SLO goodput ratios (on / off) with their
min-max over repeats. `--quick` runs it tiny; `--help` for the rest. The run is
epdserve/bench/multiturn_bench.py's.
"""
import sys

from epdserve.bench.multiturn_bench import main

if __name__ == "__main__":
    sys.exit(main())
