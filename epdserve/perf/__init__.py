"""The vocabulary bench and planner share: what a serving workload is, how it is scored, what a profile says.

bench (which runs workloads and profiles) and planner (which simulates them) both import this
package and never each other. Modules:
- `workload`: `WorkloadConfig`, `BenchRequest`, `build_workload` (seeded ShareGPT-4o-like requests),
  the chat prompt and resolution helpers;
- `presets`: the named workloads (`PRESETS`) and their request-rate sweeps (`PRESET_RATES`);
- `multiturn`: `MultiturnConfig`, `Conversation`, `build_conversations` (seeded chats over images,
  each turn the history with the earlier answers, the images re-sent);
- `turn_metrics`: `turn_metrics`, a multi-turn run's figures per turn (TTFT, cached prompt tokens);
- `arrivals`: `arrival_times`, the gamma arrival process requests are sent (or simulated) on;
- `clips`: seeded synthetic MP4 clips for the video workload;
- `serving_metrics`: `RequestRecord`, `SLO`, `compute_metrics` and `stats` (TTFT, TPOT, ITL,
  goodput, the TTFT split by stage), with vLLM's and SGLang's definitions;
- `profile_report`: the profile report's format, `interp`, `cost_at` and `unloaded_ttft`;
- `profiler`: `run_profile`, the measurements behind a profile (torch imported only when it runs).
"""
