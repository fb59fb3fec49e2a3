"""The benchmarks: `epdserve bench ...` and `epdserve profile`, each measuring configurations side by side.

Acceptance checks (does this machine and install work: `bench device`, the NPU first run) are
`epdserve.checks`'s.

Owns running workloads and measurements and reporting them; what a workload, a metric and a
profile are is `epdserve.perf` (shared with the planner; bench never imports the planner).
Modules:
- `cli`: the `bench` command group (`BENCHMARKS`, only the named benchmark imported);
- `serve`: `bench serve`, live deployments' modes side by side (each mode started and stopped by
  `deploy.local.launched`); `serve_runner` (drive one workload, record the client's view), `openai_backend` (the
  same through an OpenAI-compatible HTTP server), `roster_watch` (role changes during a run),
  `shift` (the `shift` workload, traffic whose shape changes mid-run), `multiturn` (the
  `multiturn` workload: conversations, TTFT per turn), `upload_ask` (the `upload-then-ask`
  workload: upload, think, ask by file id, beside bytes-carrying and image-less asks),
  `multiturn_runner` (closed loop per
  conversation), `multiturn_report` (its per-turn tables), `report` (rows, tables, figures),
  `spread` (bootstrap spread of a ratio between runs);
- `multiturn_bench`: the prefix cache on / off and cache-aware / least-load routing on the
  multiturn workload, one command (benchmarks/multiturn.py); `multiturn_compare` (its tables);
- `vs_peer`: epdserve's modes against a peer — `transformers serve`, or vLLM (`--peer vllm`) — on
  one workload, one command (benchmarks/vs_transformers_serve.py); `peer` (the peer's venv and
  process), `peer_vllm` (vLLM's venv, command and environment), `peer_compare` (its comparison and
  aim-ratio tables);
- `token_cost`: where a served token's CPU goes, by process and stage (benchmarks/served_token_cost.py);
- `offline_vs_vllm`: offline decode TPOT of epdserve's `LLM` against `vllm.LLM`, alternating rounds
  (benchmarks/vs_vllm_offline.py);
- `aiperf_vs_vllm`: NVIDIA's aiperf as a second client against vLLM and epdserve, alternating rounds
  (benchmarks/aiperf_vs_vllm.py);
- `budget_policy`: the step budget's policies on one engine's steps in one process, at a rate and
  in a burst, alternating rounds (benchmarks/budget_policy.py);
- `chaos`: `bench chaos`, faults under load; `chaos_faults` (find, kill, wait for recovery);
- `soak`: `bench soak`, minutes of mixed traffic on E-P-D with instances killed; `soak_traffic`
  (the catalogue and its offline outputs), `soak_load` (clients and kills), `soak_rss` (memory of
  every process), `soak_report` (counters, Markdown);
- `offline`: `bench offline`, the engine against transformers; `offline_configs`,
  `offline_workloads`, `offline_worker` (one configuration in its own process), `offline_report`;
- `host`: `bench host`, host time per decode step;
- `mm_store`: `bench mm-store`, the MM Store against raw redis-py;
- `kv_transfer_cli`: `bench kv-transfer`'s flags; `kv_transfer`: its runner and decode peer;
- `kv_prefix_reuse`: KV bytes per turn over the P->D hop with D's prefix cache on / off
  (benchmarks/kv_prefix_reuse_bench.py; `PDPair`, a P and a D engine over one gloo pair);
- `ops`: `bench ops`, native against portable paged operators;
- `colocation`: `bench colocation`, co-located encode against decode, per policy (`--device npu`:
  `epdserve.checks.npu.colocation`);
- `cli` also lists `bench device`, the device check, which lives in `epdserve.checks.device`;
- `profile`: the `epdserve profile` command (the measurements: `perf.profiler`).
"""
