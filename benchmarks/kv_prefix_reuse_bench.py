"""KV bytes per turn over the P->D hop with D's prefix cache on and off.

    python benchmarks/kv_prefix_reuse_bench.py [--model DIR] [--turns 4] [--max-tokens 16]
"""
import sys

from epdserve.bench.kv_prefix_reuse import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
