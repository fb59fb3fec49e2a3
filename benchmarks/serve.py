"""Thin script for `epdserve bench serve` (same flags): `python benchmarks/serve.py --modes monolithic,E-PD --workload mixed`."""
import sys

from epdserve.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
