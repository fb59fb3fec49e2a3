"""`epdserve bench device`: the device check (GPU / NPU / CPU; scripts/device_check.sh).

Modules:
- `check`: the command (`add_parser` / `run`): its parts, each in its own process under a timeout;
- `part`: one part in its own process (`python -m epdserve.checks.device.part`);
- `env`: what every part shares: settings, checkpoints, prompts, clocks;
- `exact`: offline `LLM` greedy output against transformers per family;
- `tp`: the same at tensor_parallel_size 2 (two devices; the CPU stands in for them); `tp_hop`: a
  prefill engine at 2 sending its KV to a decode engine at 1;
- `graphs`: decode graphs against --enforce-eager (tokens, evidence, TPOT, a final empty_cache);
- `serve`: every deployment mode launched, its greedy tokens against the offline engine's;
- `perf`: decode speed against transformers, the memory floor; `profile` (operators per token),
  `served` (the served TPOT of one request alone);
- `report`: the report's Markdown.
"""
