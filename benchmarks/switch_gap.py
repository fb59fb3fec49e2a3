"""What a role switch costs the requests that arrive during it: drained first against overlapped.

`OMP_WAIT_POLICY=PASSIVE python benchmarks/switch_gap.py --model DIR [--repeats 5] [--out F.json]`

For each `--switch-overlap` setting (off, on) one P-D deployment is launched (`epdserve launch
--mode P-D`) and its P+E merged into one coupled EPD engine (the D parks), as `--mode auto`'s
controller does on encode-light traffic. Each repeat then starts `--long` requests decoding
`--long-tokens` tokens on the coupled engine, splits it back (EPD -> P+E, the controller's move
when images return), and sends `--short` short requests during the split, one every
`--short-gap-s`; their TTFT (client side) is what the split costs new traffic. The same short
requests beside the same long decodes without a switch are the baseline. Reported: per setting,
the short requests' TTFT p50 / p90 / max over all repeats, each repeat's p50 (the spread), and the
switch's drain and rebuild seconds. One run, one machine: only the ratios between settings mean
anything.
"""
from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import threading
import time

import grpc

from epdserve.deploy.local.launched import launched
from epdserve.client import Client
from epdserve.rpc import instance_pb2, instance_pb2_grpc, serve_pb2, serve_pb2_grpc
from epdserve.security.secrets import CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER


def _prefiller(address: str, token: str) -> str:
    """The P instance's address (shown only to holders of the deployment's cluster token)."""
    with grpc.insecure_channel(address) as ch:
        info = serve_pb2_grpc.EPDServeStub(ch).GetServerInfo(serve_pb2.GetServerInfoRequest(), timeout=10,
                                                            metadata=[(CLUSTER_TOKEN_HEADER, token)])
    return next(i.address for i in info.instances if "P" in i.roles and not i.draining)


def _switch(instance: str, roles: str, token: str) -> instance_pb2.SwitchRolesResponse:
    with grpc.insecure_channel(instance) as ch:
        return instance_pb2_grpc.InstanceStub(ch).SwitchRoles(
            instance_pb2.SwitchRolesRequest(roles=roles, drain_timeout_s=300, reason="switch_gap benchmark"),
            timeout=600, metadata=[(CLUSTER_TOKEN_HEADER, token)])


def _ttft(client: Client, prompt: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    first = None
    for d in client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True):
        if first is None and d.token_ids:
            first = time.perf_counter() - t0
    return first


def _one(client: Client, instance: str, args, tag: str, switch: bool, token: str) -> dict:
    """Long decodes on the coupled engine, then (a split and) the short requests; their TTFTs."""
    longs = [threading.Thread(target=_ttft, args=(client, f"{tag} long {i}: tell a long story", args.long_tokens))
             for i in range(args.long)]
    for t in longs:
        t.start()
    time.sleep(args.settle_s)  # the long requests are decoding
    result: dict = {}
    sw = threading.Thread(target=lambda: result.update(resp=_switch(instance, "P+E", token))) if switch else None
    if sw is not None:
        sw.start()
    ttfts: list[float] = []
    shorts = []
    for i in range(args.short):
        time.sleep(args.short_gap_s)
        shorts.append(threading.Thread(target=lambda i=i: ttfts.append(_ttft(client, f"{tag} short {i}: hi", 8))))
        shorts[-1].start()
    for t in shorts + longs + ([sw] if sw else []):
        t.join()
    out = {"ttft_s": ttfts}
    if switch:
        out.update(drain_s=result["resp"].drain_s, rebuild_s=result["resp"].rebuild_s)
        _switch(instance, "EPD", token)  # merge again for the next repeat
    return out


def _summary(runs: list[dict]) -> dict:
    allt = sorted(t for r in runs for t in r["ttft_s"])
    q = statistics.quantiles(allt, n=10, method="inclusive") if len(allt) > 1 else allt * 9
    s = {"ttft_p50_ms": 1e3 * statistics.median(allt), "ttft_p90_ms": 1e3 * q[8], "ttft_max_ms": 1e3 * allt[-1],
         "repeat_p50_ms": [round(1e3 * statistics.median(r["ttft_s"]), 1) for r in runs]}
    if "drain_s" in runs[0]:
        s["drain_s"] = [round(r["drain_s"], 2) for r in runs]
        s["rebuild_s"] = [round(r["rebuild_s"], 3) for r in runs]
    return s


def run(args) -> dict:
    results = {}
    for overlap in ("off", "on"):
        token = secrets.token_urlsafe(32)  # the deployment's cluster token: instance calls need it
        with launched("P-D", args.model, ["--kv-cache-mb", "64", "--instance-args", f"--switch-overlap {overlap}"],
                      env={"OMP_WAIT_POLICY": "PASSIVE", CLUSTER_TOKEN_ENV: token}) as dep:
            instance = _prefiller(dep.address, token)
            _switch(instance, "EPD", token)  # merged: the D parks
            with Client(dep.address, timeout=600) as c:
                c.generate("warm up", max_tokens=4)
                base, split = [], []
                for r in range(args.repeats):
                    base.append(_one(c, instance, args, f"{overlap}-{r}-base", switch=False, token=token))
                    split.append(_one(c, instance, args, f"{overlap}-{r}", switch=True, token=token))
        results[overlap] = {"no switch": _summary(base), "split": _summary(split)}
    return results


def table(results: dict) -> str:
    lines = ["| --switch-overlap | during | TTFT p50 ms | p90 | max | per-repeat p50 | drain s | rebuild s |",
             "|---|---|---:|---:|---:|---|---|---|"]
    for overlap, rows in results.items():
        for during, s in rows.items():
            lines.append(f"| {overlap} | {during} | {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} | "
                         f"{s['ttft_max_ms']:.0f} | {', '.join(f'{x:.0f}' for x in s['repeat_p50_ms'])} | "
                         f"{', '.join(map(str, s.get('drain_s', []))) or '-'} | "
                         f"{', '.join(map(str, s.get('rebuild_s', []))) or '-'} |")
    on, off = results["on"]["split"], results["off"]["split"]
    lines.append(f"\nShort requests' TTFT p50 during a split, drained first / overlapped: "
                 f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x (per-repeat p50s beside each row)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. epdserve demo-model ... --size small)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--long", type=int, default=3, help="long requests decoding on the coupled engine")
    p.add_argument("--long-tokens", type=int, default=192)
    p.add_argument("--short", type=int, default=4, help="short requests sent during the split")
    p.add_argument("--short-gap-s", type=float, default=0.25)
    p.add_argument("--settle-s", type=float, default=1.0, help="after the long requests start, before the split")
    p.add_argument("--out", default=None, help="write the figures as JSON here (and the table beside it as .md)")
    args = p.parse_args()
    results = run(args)
    text = table(results)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(f"`python {' '.join(sys.argv)}`\n\n{text}\n")


if __name__ == "__main__":
    main()
