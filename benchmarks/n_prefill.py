"""What n=4 costs in prefill against n=1 (issue 40 item 3: the prompt prefilled once, its KV shared).

Two paths. ``--mode engine`` / ``--mode engine-P-D`` measure the sequence group
(engine/sequence_group.py: n as one request, the prompt prefilled once, the choices forked at the
first token; in P-D one KV transfer for all n, D forking on the imported blocks) on engines in
this process: one coupled `LLMEngine`, or a prefill-only and a decode-only engine over one real
gloo pair on loopback (epdserve/bench/kv_prefix_reuse.PDPair). ``--mode monolithic`` /
``--mode P-D`` measure the same group through the HTTP front, the scheduler and the instances
(below). In each round a fresh prompt of ``--prompt-tokens`` random token ids goes with n=1 and another with n=4 (the order
alternates round by round); the ratios are n=4 / n=1, median [min, max] over rounds.

Front modes: one deployment in this process (a scheduler with its OpenAI front and real `InstanceHost`s:
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
    python benchmarks/n_prefill.py --mode engine-P-D --rounds 7 --prompt-tokens 1024

Engine modes measure the prefilling engine's `prompt_tokens` and `prefill_s`, this process's CPU
time (`time.process_time`, every thread) and wall time over the request until its n choices
ended, and in engine-P-D the KV bytes P sent (`LayerwiseSendConnector.counters.bytes`).

How n works on the HTTP path: the front sends one request with sampling.n (each prompt's n
choices one sequence group; rpc/choice_streams.py reads its one stream apart by choice index), the
scheduler relays it as one attempt, P prefills the prompt once and draws the n first tokens
(PrefillResponse.choices), its KV crosses to D once, and D forks the choices on it
(DecodeStart.choice_first_token_ids).
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
ENGINE_MODES = ("engine", "engine-P-D")


def _spread(v: list[float]) -> dict:
    return {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}


def _engine_rounds(args, model: str) -> None:
    """The sequence group on engines in this process (the module docstring's engine modes)."""
    from epdserve.bench.kv_prefix_reuse import PDPair
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.engine_request import EngineRequest
    from epdserve.engine.llm_engine import LLMEngine
    from epdserve.engine.sampling_params import SamplingParams
    from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill

    kv = args.kv_cache_mb << 20
    pair = PDPair(model, d_kv_bytes=kv) if args.mode == "engine-P-D" else None
    eng = pair.p if pair else LLMEngine(EngineConfig(model=model, device="cpu", kv_cache_bytes=kv))
    vocab = eng.model.adapter.text_config.vocab_size
    rng, ids = random.Random(0), iter(range(10**9))

    def run(n: int) -> dict:
        rid, prompt = f"r{next(ids)}", [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, n=n)
        s0, t0, c0 = eng.stats.as_dict(), time.perf_counter(), time.process_time()
        sent0 = pair.tx.counters.bytes if pair else 0
        req = EngineRequest(rid, prompt, [], sp)
        if pair:
            pair.d.add_request(EngineRequest(rid, prompt, [], sp, kv_transfer=RemotePrefill("p0")))
            req.kv_transfer = RemoteDecode("d0", pair.rx.reserved_blocks(rid), pair.rx.cached_tokens(rid))
        eng.add_request(req)
        firsts, ends = {}, 0
        while len(firsts) < n:
            for o in eng.step():
                if o.error:
                    raise RuntimeError(o.error)
                if o.finished:
                    firsts[o.index] = o
        if pair:
            pair.rx.set_first_token(rid, firsts[0].token_ids[0], firsts[0].rope_delta,
                                    [firsts[j].token_ids[0] for j in range(1, n)])
            while ends < n or pair.p.has_pending_transfers():
                pair.p.step()
                for o in pair.d.step():
                    if o.error:
                        raise RuntimeError(o.error)
                    ends += o.finished
        wall, cpu, s1 = time.perf_counter() - t0, time.process_time() - c0, eng.stats.as_dict()
        row = {"prompt_tokens": s1["prompt_tokens"] - s0["prompt_tokens"], "prefill_s": s1["prefill_s"] - s0["prefill_s"],
               "wall_s": wall, "cpu_s": cpu, "choices": len(firsts)}
        if pair:
            row["kv_sent_bytes"] = pair.tx.counters.bytes - sent0
        return row

    try:
        run(1)  # warm-up
        ratios: dict[str, list[float]] = {}
        for r in range(args.rounds):
            row = {n: run(n) for n in ((1, args.n) if r % 2 == 0 else (args.n, 1))}
            for k in row[1]:
                if k != "choices":
                    ratios.setdefault(k, []).append(row[args.n][k] / row[1][k])
            print(json.dumps({"round": r, "mode": args.mode, **{f"n={n}": v for n, v in row.items()}}), flush=True)
        print(json.dumps({"mode": args.mode, "prompt_tokens": args.prompt_tokens, "n": args.n, "rounds": args.rounds,
                          **{f"ratio_{k}": _spread(v) for k, v in ratios.items()}}))
    finally:
        if pair:
            pair.close()


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
    ap.add_argument("--mode", choices=sorted(MODES) + list(ENGINE_MODES), default="P-D",
                    help="engine / engine-P-D: the sequence group on engines in this process; monolithic / P-D: "
                         "a deployment behind the HTTP front (see above)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2,
                    help="2 (default): in P-D the first choice reaches D (P's token, then D's) before the others start")
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    args = ap.parse_args()
    if args.mode in ENGINE_MODES:
        from epdserve.model.demo import build_demo_model

        model = args.model or str(build_demo_model(tempfile.mkdtemp(prefix="n_prefill_"), arch="qwen2_vl",
                                                   size="small", seed=0))
        _engine_rounds(args, model)
        return

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
