"""Layerwise vs after-prefill P->D KV transfer, and raw gloo (same as `epdserve bench kv-transfer`).

    python benchmarks/kv_transfer_bench.py [--shapes demo-small qwen2-vl-7b] [--tokens 300]
                                           [--layer-ms 5] [--repeats 7] [--out FILE]
"""
import sys

from epdserve.bench.kv_transfer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
