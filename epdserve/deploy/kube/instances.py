"""One Deployment per pool of the mode (instance/modes.py `mode_pools`), each pod one
`epdserve instance --roles R` on as many accelerators as its pool's tensor-parallel degree
(`KubeValues.degrees`), and a PodDisruptionBudget per role.

An instance advertises and binds its pod IP (`--host $(POD_IP)`): the scheduler reaches it there,
its D peers dial its KV rendezvous there, and its gloo pair sockets bind that address
(transfer/kv/network.py), so GLOO_SOCKET_IFNAME is not needed and not set (the downward API gives
an address, not an interface name). On Ascend, HCCL_IF_IP is the pod IP (downward API), which HCCL
prefers over HCCL_SOCKET_IFNAME, and HCCL_HOST_SOCKET_PORT_RANGE is `Ports.hccl_host_range` where one is
given (CANN documents it for some Atlas products only: ports.py).

Stopping: SIGTERM is the drain (instance_cli: deregister from every scheduler, stop taking calls,
let calls in flight finish for up to --drain-timeout, exit within it + INSTANCE_STOP_MARGIN_S);
the pod's terminationGracePeriodSeconds covers both, and no preStop hook is needed because
deregistration already happens before the drain. A rolling update adds a pod before it removes
one (maxUnavailable 0).
"""
from __future__ import annotations

import math

from epdserve.deploy.local.signals import INSTANCE_STOP_MARGIN_S
from epdserve.instance.modes import Pool
from epdserve.deploy.kube import pod
from epdserve.deploy.kube.meta import instance_name, labels, metadata, mm_store_url, scheduler_addresses
from epdserve.deploy.kube.secrets import CLUSTER_TOKEN, MM_STORE_PASSWORD, secret_env
from epdserve.deploy.kube.values import KubeValues

COMPONENT = "instance"


def instance_args(v: KubeValues, roles: str) -> list[str]:
    return ["instance", "--roles", roles, "--model", v.model, "--device", v.flavour_spec.device,
            "--scheduler", ",".join(scheduler_addresses(v)), "--mm-store", mm_store_url(v),
            "--host", f"$({pod.POD_IP})", "--port", str(v.ports.instance),
            *(["--kv-cache-mb", str(v.kv_cache_mb)] if v.kv_cache_mb is not None else []),
            *(["--dtype", v.dtype] if v.dtype else []),
            *(["--tensor-parallel-size", str(degree)] if (degree := _degree(v, roles)) > 1 else []),
            "--drain-timeout", f"{v.drain_timeout:g}"]


def _degree(v: KubeValues, roles: str) -> int:
    """The pool's tensor-parallel degree (`KubeValues.degrees`: instance/modes.py `pool_degrees`, which
    refuses a P->D pair of degrees the KV hop does not carry)."""
    return v.degrees[roles]


def instance_env(v: KubeValues) -> list[dict]:
    env = [*pod.downward_env(), secret_env(v, CLUSTER_TOKEN), secret_env(v, MM_STORE_PASSWORD)]
    if v.flavour_spec.device == "npu":
        env.append(pod.field_env("HCCL_IF_IP", "status.podIP"))
        if v.ports.hccl_host_range:
            env.append({"name": "HCCL_HOST_SOCKET_PORT_RANGE", "value": v.ports.hccl_host_range})
    env += [{"name": k, "value": val} for k, val in v.flavour_spec.env.items()]
    return env


def grace_seconds(v: KubeValues) -> int:
    return math.ceil(v.drain_timeout + INSTANCE_STOP_MARGIN_S) + 5


def instance_container(v: KubeValues, roles: str) -> dict:
    f = v.flavour_spec
    extra = {v.resource: _degree(v, roles)} if v.resource else None  # one accelerator per rank
    return {
        "name": "instance", "image": v.image_ref, "imagePullPolicy": v.image_pull_policy,
        "command": list(f.command), "args": instance_args(v, roles), "env": instance_env(v),
        "ports": [{"name": "grpc", "containerPort": v.ports.instance}],
        **pod.probes(v.ports.instance, v.startup_seconds),
        "resources": pod.resources(f.cpu, f.memory, extra),
        "securityContext": pod.container_security(),
        "volumeMounts": pod.model_mounts(),
    }


def deployment(v: KubeValues, p: Pool) -> dict:
    f = v.flavour_spec
    sel = labels(v, COMPONENT, p.roles)
    extra = {}
    if f.node_selector:
        extra["nodeSelector"] = dict(f.node_selector)
    if f.tolerations:
        extra["tolerations"] = [dict(t) for t in f.tolerations]
    template_meta = {"labels": sel, "annotations": {"epdserve.io/roles": p.roles}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(v, instance_name(v, p.roles),
                                                                                 COMPONENT, p.roles),
            "spec": {"replicas": p.count, "selector": {"matchLabels": sel},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "template": {"metadata": template_meta,
                                  "spec": pod.pod_spec(v, [instance_container(v, p.roles)], grace_seconds(v),
                                                       **extra)}}}


def disruption_budget(v: KubeValues, p: Pool) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(v, instance_name(v, p.roles), COMPONENT, p.roles),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(v, COMPONENT, p.roles)}}}


def objects(v: KubeValues) -> list[dict]:
    out = []
    for p in v.pools:
        out += [deployment(v, p), disruption_budget(v, p)]
    return out
