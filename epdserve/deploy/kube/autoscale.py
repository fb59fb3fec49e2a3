"""A KEDA ScaledObject (keda.sh/v1alpha1) per role: KEDA makes and drives that role's
HorizontalPodAutoscaler from a Prometheus query on an `epdserve:` metric.

Why KEDA rather than the Prometheus adapter: each role's query lives in its own object, next to
the Deployment it scales, while the adapter needs cluster-wide rules in its own configuration.
The query is the requests waiting on the role's instances, each instance counted once however
many schedulers report it: `sum(max by (instance) (epdserve:instance_waiting_requests{roles=R}))`;
KEDA keeps about `scale_waiting` of them per replica, between the pool's size and
`max_replicas`. Scaling a role changes only that Deployment's replicas: new instances register
with every scheduler and take work at once.
"""
from __future__ import annotations

from epdserve.instance.modes import Pool
from epdserve.deploy.kube.meta import instance_name, metadata, scheduler_name
from epdserve.deploy.kube.values import KubeValues

API_VERSION = "keda.sh/v1alpha1"
METRIC = "epdserve:instance_waiting_requests"


def query(v: KubeValues, roles: str) -> str:
    sel = f'namespace="{v.namespace}",service="{scheduler_name(v)}",roles="{roles}"'
    return f"sum(max by (instance) ({METRIC}{{{sel}}})) or vector(0)"


def scaled_object(v: KubeValues, p: Pool) -> dict:
    name = instance_name(v, p.roles)
    return {"apiVersion": API_VERSION, "kind": "ScaledObject", "metadata": metadata(v, name, "instance", p.roles),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                     "minReplicaCount": p.count, "maxReplicaCount": max(p.count, v.max_replicas),
                     "pollingInterval": 15, "cooldownPeriod": 300,
                     "triggers": [{"type": "prometheus",
                                   "metadata": {"serverAddress": v.prometheus_url, "query": query(v, p.roles),
                                                "threshold": str(v.scale_waiting)}}]}}


def objects(v: KubeValues) -> list[dict]:
    return [scaled_object(v, p) for p in v.pools] if v.autoscale else []
