"""What n=4 costs in prefill against n=1 (issue 40 item 3: the prompt prefilled once, its KV shared).

One deployment in this process (a scheduler with its OpenAI front and real `InstanceHost`s:
``--mode monolithic`` one EPD instance, ``--mode P-D`` P and D over a real gloo KV pair). Each
round sends a fresh prompt of ``--prompt-tokens`` random token ids to /v1/completions with
``max_tokens=2`` (P's token and D's) and n=1, and another fresh one with n=4 (fresh prompts: nothing of an earlier
round is cached; the order alternates round by round). Measured on the prefilling instance's engine (`EngineStats`): `prefill_s`, the
execute time of its steps holding prompt tokens, and `prompt_tokens`, the prompt tokens it
computed, and in P-D the KV bytes P sent to D; plus the request's wall time at the client and this process's CPU time over it (every
thread of the deployment: less disturbed than wall time by other jobs on a shared machine). Prints one JSON line per round and the
ratios n=4 / n=1 (median [min, max] over rounds).

    python benchmarks/n_prefill.py --mode P-D --rounds 5 --prompt-tokens 1024   # builds the small demo model
    python benchmarks/n_prefill.py --model DIR --mode monolithic

How n works (epdserve/rpc/choices.py, epdserve/entrypoints/http/app.py `_firsts`): the first
choice runs alone until its second message is out (or it ended), then the other n-1 start; their
prompts hit the prefix caches the first one filled (P's, and D's in P-D), so each computes, and
sends to D, only the prompt's last block.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import statistics
import tempfile
import time

MODES = {"monolithic": (("epd0", "EPD"),), "P-D": (("p0", "P+E"), ("d0", "D"))}


def post(address: str, body: dict) -> dict:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data}")
    return data


def prefill_counters(host) -> dict:
    w = next(w for w in host.all_workers() if getattr(w, "engine", None) is not None
             and w.engine.config.prefills)
    s = w.engine.stats.as_dict()
    return {"prefill_s": s["prefill_s"], "prompt_tokens": s["prompt_tokens"],
            "kv_sent_bytes": host.status().load.kv_sent_bytes}  # P->D KV bytes (P-D; 0 monolithic)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the 'small' demo model in a temp dir)")
    ap.add_argument("--mode", choices=sorted(MODES), default="P-D")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2,
                    help="2 (default): in P-D the first choice reaches D (P's token, then D's) before the others start")
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    args = ap.parse_args()

    from epdserve.entrypoints.http import HttpFront, HttpOptions
    from epdserve.instance.config import InstanceConfig
    from epdserve.instance.host import InstanceHost
    from epdserve.model.demo import build_demo_model
    from epdserve.scheduler import SchedulerConfig, SchedulerThread

    model = args.model or str(build_demo_model(tempfile.mkdtemp(prefix="n_prefill_"), arch="qwen2_vl", size="small",
                                               seed=0))
    sched = SchedulerThread(SchedulerConfig(model=model, probe_interval_s=0.2, heartbeat_interval_s=0.5))
    sched.start()
    hosts, front = [], None
    try:
        for iid, roles in MODES[args.mode]:
            hosts.append(InstanceHost(InstanceConfig(roles=roles, model=model, scheduler=sched.server.internal_address,
                                                     instance_id=iid, kv_cache_bytes=args.kv_cache_mb << 20)).start())
        deadline = time.monotonic() + 300
        while len(sched.call(sched.server.registry.records)) < len(hosts):
            if time.monotonic() > deadline:
                raise RuntimeError("instances did not register")
            time.sleep(0.2)
        front = HttpFront(sched.server, HttpOptions())
        asyncio.run_coroutine_threadsafe(front.start(), sched.loop).result(30)
        vocab = sched.server.dispatcher.preprocessor.vocab_size
        rng = random.Random(0)
        prompt = lambda: [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]  # noqa: E731
        post(front.address, {"prompt": prompt(), "max_tokens": 1})  # warm-up
        ratios = {"prefill_s": [], "prompt_tokens": [], "wall_s": [], "cpu_s": []}
        if args.mode == "P-D":
            ratios["kv_sent_bytes"] = []
        for r in range(args.rounds):
            row = {}
            for n in ((1, args.n) if r % 2 == 0 else (args.n, 1)):  # alternate: the machine's drift cancels
                before, t0, c0 = prefill_counters(hosts[0]), time.perf_counter(), time.process_time()
                out = post(front.address, {"prompt": prompt(), "max_tokens": args.max_tokens, "n": n, "temperature": 0,
                                           "ignore_eos": True})
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                after = prefill_counters(hosts[0])
                row[n] = {k: after[k] - before[k] for k in after} | {
                    "wall_s": wall, "cpu_s": cpu, "choices": len(out["choices"]),
                    "usage_prompt_tokens": out["usage"]["prompt_tokens"]}
            for k in ratios:
                ratios[k].append(row[args.n][k] / row[1][k])
            print(json.dumps({"round": r, "mode": args.mode, **{f"n={n}": v for n, v in row.items()}}), flush=True)
        print(json.dumps({"mode": args.mode, "prompt_tokens": args.prompt_tokens, "n": args.n, "rounds": args.rounds,
                          **{f"ratio_{k}": {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                                            "max": round(max(v), 3)} for k, v in ratios.items()}}))
    finally:
        if front is not None:
            asyncio.run_coroutine_threadsafe(front.stop(), sched.loop).result(30)
        for h in hosts:
            h.stop()
        sched.stop()


if __name__ == "__main__":
    main()
