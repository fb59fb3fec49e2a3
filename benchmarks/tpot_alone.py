"""One request alone, 64 tokens, greedy: served time per token (launched modes) against the offline
engine's, in one run. `OMP_WAIT_POLICY=PASSIVE python benchmarks/tpot_alone.py MODEL_DIR [REPEATS] [MODES]`
(the launcher passes the OpenMP policy of this environment on to its instances)."""
import os, re, signal, statistics, subprocess, sys, time
from epdserve.client import Client
MODEL = sys.argv[1]; REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
PROMPTS = [f"Tell me a long story number {i} about a lighthouse keeper" for i in range(REPEATS)]

def served(interval_ms, mode="monolithic"):
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, "-m", "epdserve.entrypoints.cli", "launch", "--mode", mode, "--model", MODEL,
                          "--kv-cache-mb", "64", "--instance-args", f"--stream-interval-ms {interval_ms}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    for line in p.stdout:
        m = re.search(r"epdserve ready: grpc://(\S+)", line)
        if m: break
    out = []
    try:
        with Client(m.group(1), timeout=300) as c:
            c.generate("warm up", max_tokens=8)
            for pr in PROMPTS:
                first = None; n = 0
                for d in c.generate_stream(pr, max_tokens=64, ignore_eos=True):
                    if d.token_ids:
                        if first is None: first = time.perf_counter(); n += len(d.token_ids) - 1
                        else: n += len(d.token_ids)
                end = time.perf_counter()
                out.append((end - first) / n * 1000)
    finally:
        os.killpg(p.pid, signal.SIGTERM); p.wait(60)
    return out

def offline():
    from epdserve.entrypoints.llm import LLM
    from epdserve.engine.sampling_params import SamplingParams
    llm = LLM(model=MODEL, device="cpu")
    llm.generate(["warm up"], SamplingParams(max_tokens=8))
    out = []
    for pr in PROMPTS:
        t0 = time.perf_counter(); llm.generate([pr], SamplingParams(max_tokens=1, ignore_eos=True)); t1 = time.perf_counter()
        llm.generate([pr], SamplingParams(max_tokens=64, ignore_eos=True)); t2 = time.perf_counter()
        out.append(((t2 - t1) - (t1 - t0)) / 63 * 1000)  # 64 tokens minus the prefill+first token
    return out

POLICY = os.environ.get("OMP_WAIT_POLICY", "default") + " spin " + os.environ.get("GOMP_SPINCOUNT", "-")
MODES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["monolithic"]
res = {"offline (OMP " + POLICY + ")": offline()}
for mode in MODES:
    res["served " + mode] = served(0, mode)
base_key = next(iter(res))
base = statistics.median(res[base_key])
for k, v in res.items():
    print(f"{k:24s} per-token ms p50 {statistics.median(v):6.2f}  (min {min(v):.2f} max {max(v):.2f}, n={len(v)})  vs offline {statistics.median(v)/base:.2f}x")
