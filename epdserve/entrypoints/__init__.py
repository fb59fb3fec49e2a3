"""The `epdserve` command and the offline API: what a user runs or imports at the top.

One sentence per module:
- cli.py            the `epdserve` command: one sub-command per module, each registered via `add_parser`
- launch.py         `epdserve launch`: one deployment mode on this machine (scheduler + instances as children)
- launch_settings.py  LaunchSettings: every `epdserve launch` option as a field (flag, --config key, default)
- scheduler_cli.py  `epdserve scheduler`: the global scheduler process until signalled
- instance_cli.py   `epdserve instance`: one instance process (its stage workers) until signalled
- fronts.py         the scheduler's fronts beside gRPC: HTTP, Prometheus metrics, their security options
- http/             the OpenAI-compatible HTTP front (FastAPI + uvicorn)
- llm.py            `LLM` / `SamplingParams`: the offline API in vLLM's shape
- doctor_cli.py     `epdserve doctor`: what this machine has for epdserve, as a table, and what to fix (its checks: epdserve/checks/)
- build_ops_cli.py  `epdserve build-ops`: build the native operators (csrc/) ahead of time
"""
