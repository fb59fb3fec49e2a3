"""MM Store put/get vs raw redis-py set/get (same as `epdserve bench mm-store`).

    python benchmarks/mm_store_bench.py [--tokens 256 1024] [--iters 20] [--url redis://...] [--out FILE]
"""
import sys

from epdserve.bench.mm_store import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
