"""`epdserve plan`: predict the SLO goodput of every deployment mode and E:P:D split, pick one.

- `costs`: per-stage cost functions fitted to `epdserve profile`'s measurements;
- `shapes`: a workload (a preset by name, or a recorded `bench serve` trace) as request shapes
  (arrival, vision tokens per item, text tokens, output tokens);
- `deployment`: a mode and its instance pools placed on devices, the splits that fit N devices,
  and the launch config of one;
- `simulate`: a discrete-event simulation of one deployment serving one workload;
- `rank`: every candidate simulated, scored with `bench.metrics`, ranked;
- `validate`: predicted against measured goodput for a `bench serve` results file;
- `cli`: the command.

The prediction comes from the profile and the simulation only, never from a benchmark's results.
"""
