"""`render(values)`: every object of a release, as plain dicts in apply order; `to_yaml` writes
them as one multi-document YAML stream.

Order: the Secret (when generated), the MM Store, the scheduler, the instances, then the
policies, the ServiceMonitor and the ScaledObjects, so `kubectl apply -f` creates what others
refer to first. Nothing here talks to a cluster.
"""
from __future__ import annotations

import copy

import yaml

from epdserve.deploy.kube import autoscale, instances, mm_store, monitoring, network, scheduler
from epdserve.deploy.kube.secrets import secret
from epdserve.deploy.kube.values import KubeValues

WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def render(v: KubeValues) -> list[dict]:
    out = [secret(v)] if v.secrets == "generate" else []
    for part in (mm_store, scheduler, instances, network, monitoring, autoscale):
        out += part.objects(v)
    return copy.deepcopy(out)  # no dict shared between objects: a caller may edit one


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # every object written out whole, no &anchors
        return True


def to_yaml(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def pod_templates(objects: list[dict]):
    """(workload object, its pod spec) for every Deployment and StatefulSet."""
    for obj in objects:
        if obj["kind"] in WORKLOAD_KINDS:
            yield obj, obj["spec"]["template"]["spec"]


def containers(objects: list[dict], init: bool = True):
    """(workload object, container) for every container of every pod template, init containers first."""
    for obj, spec in pod_templates(objects):
        for c in (spec.get("initContainers", []) if init else []) + spec["containers"]:
            yield obj, c
