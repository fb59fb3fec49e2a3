"""The step itself against vLLM's, offline: decode TPOT of epdserve's `LLM` and `vllm.LLM` on the
same checkpoint, dtype and batch sizes, alternating rounds (issue 50 item 5):

    python benchmarks/vs_vllm_offline.py --dtype bfloat16 --batches 1,32 --rounds 3 --out $OUT/offline-vs-vllm.md

The run itself is epdserve/bench/offline_vs_vllm.py's (`--help`).
"""
import sys

from epdserve.bench.offline_vs_vllm import main

if __name__ == "__main__":
    sys.exit(main())
