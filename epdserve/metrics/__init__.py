"""Prometheus metrics of a scheduler (prometheus_client), vLLM-style names under ``epdserve:``.

`ServingMetrics` owns one `CollectorRegistry` (no process-global state): request metrics are
observed on the public request path (`SchedulerServer.generate`, which both the gRPC and the
HTTP fronts take); roster and instance-engine metrics are read from the scheduler's registry at
scrape time (`roster.RosterCollector`). Calls refused before that path are counted in the same
``epdserve:requests_total`` by `refusals.RefusalCounter` (a gRPC interceptor), and every HTTP
response by route and status by `http_responses.CountResponses` (ASGI middleware). It is served
on the HTTP front's /metrics and, for gRPC-only deployments, on `--metrics-port`
(`entrypoints.http.server.MetricsFront`).

One sentence per module:
- serving.py         `ServingMetrics`: the registry and the request-path metrics
- roster.py          `RosterCollector`: roster and instance-engine metrics, read at scrape time
- refusals.py        `RefusalCounter`: gRPC calls refused before the request path
- http_responses.py  `CountResponses`: every HTTP response by route and status
- controller.py      `ControllerMetrics`: the `--mode auto` controller's decisions and switches
"""
from epdserve.metrics.serving import ServingMetrics

__all__ = ["ServingMetrics"]
