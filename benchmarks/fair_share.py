"""Fair share between tenants, measured (issue 51): tenant A's time to first token alone, and while
tenant B floods the same deployment, under `--scheduling-policy fair` and `fcfs`.

One launched monolithic deployment per (policy, round), a keys file with tenants A and B, the
instance held to `--max-num-seqs` slots so that B's flood fills it. In each deployment:
- alone: A sends --requests streamed requests one after another (max_tokens 8) and records each
  TTFT (first streamed token, at the client);
- flood (`--flood fanout`): B keeps --flood-streams requests in flight back to back, each n =
  --flood-n choices of --flood-tokens tokens (B's sequences are what fills the slots), while A sends
  its requests the same way;
- flood (`--flood schemas`): B keeps --flood-streams requests in flight back to back, each with a
  JSON schema new to the engine (an enum of --schema-values values: a compile of about a second
  here), while A sends requests each with a small schema new to the engine (a compile of
  milliseconds): what A waits for is B's compiles ahead of its own;
- flood (`--flood uploads`): B keeps --flood-streams uploads in flight back to back, each a new
  --upload-px square JPEG (decoded, keyed and encoded by the vision tower at once), while A sends
  plain text requests.
Rounds alternate the policies (fair, fcfs, fair, fcfs, ...) so a drift of this shared machine hits
both; the report gives A's TTFT p50 and p99 over every request of every round, each policy's
flood/alone ratio, and each round's own medians (the spread).

    python benchmarks/fair_share.py --model DIR --rounds 2 --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

A_KEY, B_KEY = "sk-bench-tenant-a", "sk-bench-tenant-b"


def _schema(tag: str, values: int) -> dict:
    """A schema new to the engine (`tag` is its first enum value) of `values` enum values."""
    return {"type": "object", "properties": {"answer": {"enum": [tag] + [f"v{i}" for i in range(values - 1)]}},
            "required": ["answer"], "additionalProperties": False}


def _ttft(address: str, key: str, prompt: str, structured: dict | None = None) -> float:
    from epdserve import Client

    extra = {"structured": {"json": structured}} if structured else {"ignore_eos": True}
    with Client(address, timeout=300, api_key=key) as c:
        t0 = time.perf_counter()
        for delta in c.generate_stream(prompt, max_tokens=8, **extra):
            if delta.token_ids:
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def _flood(address: str, stop: threading.Event, a: argparse.Namespace, stream: int, errors: list) -> None:
    from epdserve import Client
    from epdserve.model.demo_images import jpeg_bytes, procedural_image

    try:
        with Client(address, timeout=600, api_key=B_KEY) as c:
            i = 0
            while not stop.is_set():
                if a.flood == "uploads":
                    f = c.upload(jpeg_bytes(procedural_image(a.upload_px, a.upload_px, seed=stream * 100_000 + i)))
                    c.delete_upload(f.file_id)
                elif a.flood == "schemas":
                    c.generate(f"flood request {i}", max_tokens=4,
                               structured={"json": _schema(f"b{stream}-{i}-{time.monotonic_ns()}", a.schema_values)})
                else:
                    c.generate_choices(f"flood request {i} from tenant b", n=a.flood_n, max_tokens=a.flood_tokens,
                                       ignore_eos=True, temperature=1.0, seed=i)
                i += 1
    except Exception as e:  # noqa: BLE001 - reported by the caller
        errors.append(e)


def one_round(model: str, policy: str, a: argparse.Namespace, keys: Path) -> dict:
    from epdserve.deploy.local.launched import launched

    inst = f"--max-num-seqs {a.slots} --scheduling-policy {policy} --dtype {a.dtype}"
    extra = ["--instance-args", inst, "--scheduler-args",
             f"--api-keys-file {keys} --max-sequences-per-tenant {a.slots * 64}"]
    with launched("monolithic", model, extra, ready_timeout_s=600, env={"OMP_WAIT_POLICY": "PASSIVE"}) as dep:
        prompts = [f"tenant a asks question number {i}, please answer briefly" for i in range(a.requests)]
        small = (lambda: _schema(f"a-{time.monotonic_ns()}", 3)) if a.flood == "schemas" else (lambda: None)
        _ttft(dep.address, A_KEY, "warm-up", small())
        alone = [_ttft(dep.address, A_KEY, p, small()) for p in prompts]
        stop, errors = threading.Event(), []
        floods = [threading.Thread(target=_flood, args=(dep.address, stop, a, k, errors))
                  for k in range(a.flood_streams)]
        for t in floods:
            t.start()
        time.sleep(a.flood_warmup_s)  # let B's sequences fill the slots before A asks
        flood = [_ttft(dep.address, A_KEY, p, small()) for p in prompts]
        stop.set()
        for t in floods:
            t.join(600)
        if errors:
            raise RuntimeError(f"B's flood failed: {errors[0]!r}")
    return {"policy": policy, "alone_s": alone, "flood_s": flood}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(rounds: list[dict]) -> str:
    lines = ["| policy | A alone p50 / p99 (ms) | A under B's flood p50 / p99 (ms) | flood / alone p50, p99 | "
             "per-round medians alone / flood (ms) |", "|---|---|---|---|---|"]
    for policy in ("fair", "fcfs"):
        rs = [r for r in rounds if r["policy"] == policy]
        if not rs:
            continue
        alone = [x for r in rs for x in r["alone_s"]]
        flood = [x for r in rs for x in r["flood_s"]]
        per = ", ".join(f"{statistics.median(r['alone_s']) * 1e3:.0f} / {statistics.median(r['flood_s']) * 1e3:.0f}"
                        for r in rs)
        lines.append(f"| {policy} | {_pct(alone, .5) * 1e3:.0f} / {_pct(alone, .99) * 1e3:.0f} | "
                     f"{_pct(flood, .5) * 1e3:.0f} / {_pct(flood, .99) * 1e3:.0f} | "
                     f"{_pct(flood, .5) / _pct(alone, .5):.2f}x, {_pct(flood, .99) / _pct(alone, .99):.2f}x | {per} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2, help="deployments per policy, alternated")
    p.add_argument("--requests", type=int, default=12, help="A's requests alone and under the flood")
    p.add_argument("--slots", type=int, default=8, help="the instance's --max-num-seqs")
    p.add_argument("--flood-streams", type=int, default=4, help="B's requests in flight")
    p.add_argument("--flood-n", type=int, default=8, help="choices per B request (n)")
    p.add_argument("--flood-tokens", type=int, default=64, help="max_tokens of B's requests")
    p.add_argument("--flood", choices=("fanout", "schemas", "uploads"), default="fanout")
    p.add_argument("--upload-px", type=int, default=448, help="uploads flood: the images' side")
    p.add_argument("--schema-values", type=int, default=12000, help="schemas flood: enum values of B's schemas")
    p.add_argument("--flood-warmup-s", type=float, default=3.0)
    p.add_argument("--out", help="JSON of every TTFT")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"a {A_KEY}\nb {B_KEY}\n")
        keys.chmod(0o600)
        rounds = []
        for r in range(a.rounds):
            for policy in ("fair", "fcfs"):
                print(f"round {r + 1}: {policy} ...", file=sys.stderr, flush=True)
                rounds.append(one_round(a.model, policy, a, keys))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rounds": rounds}, indent=1))
    print(report(rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
