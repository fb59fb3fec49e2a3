"""A second client (NVIDIA's aiperf) against vLLM and epdserve on one checkpoint, alternating rounds:

    python benchmarks/aiperf_vs_vllm.py --rounds 2 --out $OUT/aiperf-vs-vllm.md

The run itself is epdserve/bench/aiperf_vs_vllm.py's (`--help`).
"""
import sys

from epdserve.bench.aiperf_vs_vllm import main

if __name__ == "__main__":
    sys.exit(main())
