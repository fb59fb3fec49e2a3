"""`epdserve plan`: predict the SLO goodput of every deployment mode and E:P:D split, pick one.

- `reports`: reading the JSON reports the planner takes (profiles, `bench serve` results);
- `costs`: per-stage cost functions fitted to `epdserve profile`'s measurements;
- `shapes`: a workload (a preset by name, or a recorded `bench serve` trace) as request shapes
  (arrival, vision tokens per item, text tokens, output tokens);
- `deployment`: a mode and its instance pools placed on devices, the splits that fit N devices,
  and the launch config of one;
- `workers`: the simulated stage workers (what each queues, what one step does);
- `simulate`: a discrete-event simulation of one deployment serving one workload;
- `rank`: every candidate simulated, scored with `perf.serving_metrics`, ranked;
- `validate`: predicted against measured goodput for a `bench serve` results file;
- `cli`: the command;
- `auto`: `launch --mode auto`'s starting deployment (a cached profile, measured once if absent).

The prediction comes from the profile and the simulation only, never from a benchmark's results.
Workloads, metrics and the profile format are `epdserve.perf`; the planner never imports bench.
"""
