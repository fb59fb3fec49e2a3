"""Decode speed of two checkouts, paired in one run: `decode_tpot.py` alternately from each (A B A B
...), per configuration, the ratio taken pair by pair (the machine's speed drifts; pairs cancel it).

    python benchmarks/decode_ab.py --model DIR --a . --b /tmp/before --rounds 3 \
        --config float32:1 --config bfloat16:1 --config float32:32 --config bfloat16:32

--a / --b: repository roots (a checkout of the commit to compare against: `git worktree add
/tmp/before COMMIT`); each run imports epdserve from its root (PYTHONPATH). Prints, per
configuration, A's and B's TPOT (median of rounds, [min, max]), tok/s, and B/A per pair.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(root: str, model: str, dtype: str, batch: int, tokens: int, repeats: int, chain: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(root).resolve()))
    cmd = [sys.executable, str(HERE / "decode_tpot.py"), "--model", model, "--dtype", dtype, "--batch", str(batch),
           "--tokens", str(tokens), "--repeats", str(repeats)] + (["--chain"] if chain else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--a", default=".", help="the checkout under test (default: this one)")
    ap.add_argument("--b", required=True, help="the checkout to compare against")
    ap.add_argument("--config", action="append", default=[], help="DTYPE:BATCH (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3, help="decode_tpot.py's own repeats per run")
    args = ap.parse_args()
    for spec in args.config or ["float32:1"]:
        dtype, batch = spec.split(":")
        a, b = [], []
        for _ in range(args.rounds):
            a.append(run(args.a, args.model, dtype, int(batch), args.tokens, args.repeats, chain=True))
            b.append(run(args.b, args.model, dtype, int(batch), args.tokens, args.repeats, chain=False))
        ta, tb = [r["tpot_ms"] for r in a], [r["tpot_ms"] for r in b]
        ratios = [y / x for x, y in zip(ta, tb)]
        chain = [r["tpot_over_chain"] for r in a]
        print(json.dumps({
            "dtype": dtype, "batch": int(batch), "rounds": args.rounds,
            "a_tpot_ms": statistics.median(ta), "a_range": [min(ta), max(ta)],
            "a_tok_s": round(int(batch) / statistics.median(ta) * 1e3, 1),
            "b_tpot_ms": statistics.median(tb), "b_range": [min(tb), max(tb)],
            "b_tok_s": round(int(batch) / statistics.median(tb) * 1e3, 1),
            "b_over_a": round(statistics.median(ratios), 2), "b_over_a_range": [round(min(ratios), 2), round(max(ratios), 2)],
            "a_tpot_over_matmul_chain": statistics.median(chain), "a_chain_range": [min(chain), max(chain)]}), flush=True)


if __name__ == "__main__":
    main()
