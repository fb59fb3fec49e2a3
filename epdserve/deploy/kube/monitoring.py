"""The ServiceMonitor (Prometheus Operator, monitoring.coreos.com/v1) that scrapes the
schedulers' `/metrics` on their HTTP port with the release's scrape token (the Secret's
`metrics-token`, the scheduler's EPDSERVE_METRICS_TOKEN), never the clients' API key: the scrape
configuration is read by more people than hold client keys, and a client key read from it would
serve requests. Plain HTTP: the renderer configures no TLS on the scheduler's HTTP port.

One scrape target per scheduler replica covers the whole deployment: a scheduler exports its
instances' load (metrics/roster.py), so no instance port is scraped. `honorLabels` keeps
epdserve's own `instance` label (the opaque instance id) instead of renaming it, so the replicas'
copies of one instance's series share their labels but the target's `pod`; queries de-duplicate
with `max by (instance)` (autoscale.py).
"""
from __future__ import annotations

from epdserve.deploy.kube.meta import labels, metadata, scheduler_name
from epdserve.deploy.kube.secrets import METRICS_TOKEN, SECRET_ENV
from epdserve.deploy.kube.values import KubeValues

API_VERSION = "monitoring.coreos.com/v1"


def objects(v: KubeValues) -> list[dict]:
    if not v.service_monitor:
        return []
    endpoint = {"port": "http", "path": "/metrics", "scheme": "http", "interval": "15s", "honorLabels": True,
                "authorization": {"type": "Bearer",
                                  "credentials": {"name": v.secret_name, "key": SECRET_ENV[METRICS_TOKEN]}}}
    return [{"apiVersion": API_VERSION, "kind": "ServiceMonitor",
             "metadata": metadata(v, scheduler_name(v), "scheduler"),
             "spec": {"selector": {"matchLabels": labels(v, "scheduler")},
                      "namespaceSelector": {"matchNames": [v.namespace]}, "endpoints": [endpoint]}}]
