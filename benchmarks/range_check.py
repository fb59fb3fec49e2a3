"""How long `epdserve.rpc.ranges.check_request` takes on a prompt of a million token ids, against
the Python loop it replaced (the dispatcher runs the check on its event loop, so it must stay in
milliseconds). Both are timed in this one run, `--repeats` times each, interleaved; the ratio's
median and spread are printed.

    python benchmarks/range_check.py --repeats 20
"""
from __future__ import annotations

import argparse
import statistics
import time

from epdserve.rpc import serve_pb2
from epdserve.rpc.ranges import check_request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=1 << 20, help="prompt length in token ids (default 2^20)")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs of each (default 20)")
    args = ap.parse_args()
    req = serve_pb2.GenerateRequest()
    req.prompt_token_ids.ids.extend(range(args.ids))
    vocab = args.ids
    checks, loops = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        check_request(req, vocab_size=vocab)
        checks.append(time.perf_counter() - t)
        t = time.perf_counter()
        bad = [x for x in req.prompt_token_ids.ids if not 0 <= x < vocab]
        loops.append(time.perf_counter() - t)
        assert not bad
    ratios = sorted(c / lo for c, lo in zip(checks, loops))
    print(f"{args.ids} ids, {args.repeats} repeats")
    print(f"check_request: median {statistics.median(checks) * 1e3:.2f} ms (min {min(checks) * 1e3:.2f}, max {max(checks) * 1e3:.2f})")
    print(f"python loop:   median {statistics.median(loops) * 1e3:.2f} ms (min {min(loops) * 1e3:.2f}, max {max(loops) * 1e3:.2f})")
    print(f"ratio check/loop: median {statistics.median(ratios):.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
