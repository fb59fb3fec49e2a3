"""epdserve against `transformers serve --continuous-batching`, one chat workload, one command:

    OMP_WAIT_POLICY=PASSIVE python benchmarks/vs_transformers_serve.py \
        --out bench-results/vs-transformers-serve.json

24 chat requests (half with one 320x180-640x360 JPEG), Poisson arrivals at 0.5 and 1.0 req/s, 32
output tokens, the small demo Qwen2-VL; the peer (its own venv, built on first use), then epdserve
monolithic, E-PD and P-D, back to back, 3 runs of each rate; prints TTFT p50, TPOT p50/p90/p99, ITL
p99 and SLO goodput per rate and target with their spread, and the ratios its aims use.
`--quick` runs it tiny; `--help` for the rest. The run itself is epdserve/bench/vs_peer.py's.
"""
import sys

from epdserve.bench.vs_peer import main

if __name__ == "__main__":
    sys.exit(main())
