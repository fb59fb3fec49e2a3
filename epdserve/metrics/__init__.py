"""Prometheus metrics of a scheduler (prometheus_client), vLLM-style names under ``epdserve:``.

`ServingMetrics` owns one `CollectorRegistry` (no process-global state): request metrics are
observed on the public request path (`SchedulerServer.generate`, which both the gRPC and the
HTTP fronts take); roster and instance-engine metrics are read from the scheduler's registry at
scrape time (`roster.RosterCollector`). Calls refused before that path are counted in the same
``epdserve:requests_total`` by `refusals.RefusalCounter` (a gRPC interceptor), and every HTTP
response by route and status by `http_responses.CountResponses` (ASGI middleware). It is served
on the HTTP front's /metrics and, for gRPC-only deployments, on `--metrics-port` (`MetricsFront`).
"""
from epdserve.metrics.serving import ServingMetrics

__all__ = ["ServingMetrics"]
