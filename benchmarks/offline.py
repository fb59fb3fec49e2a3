"""Thin script for `epdserve bench offline` (same flags): `python benchmarks/offline.py --workload all`."""
import sys

from epdserve.bench.offline import main

if __name__ == "__main__":
    sys.exit(main())
