"""The scheduler: a StatefulSet of `scheduler_replicas` (>= 2 by default), its public Service,
the headless Service that names each replica, and a PodDisruptionBudget.

Why a StatefulSet and not a Deployment: an instance registers with every scheduler it is
given (`epdserve instance --scheduler a:1,b:2`: one registrar per address, fixed at start), and
two schedulers serve one set of instances only if each knows every instance. A Service address
would reach one replica per connection; a StatefulSet's pods have stable DNS names through the
headless Service (`<release>-scheduler-0.<release>-scheduler-internal`) that survive a restart,
so the list is written once. `podManagementPolicy: Parallel` starts and replaces them like a
Deployment's. Clients use the public Service (`Client("<release>-scheduler:PORT")`) or the list.

Ports: public gRPC and HTTP bind every interface (the API key guards them; the kubelet's probes
and `kubectl port-forward` reach them); the Registry binds the pod IP (the cluster token guards it).
On SIGTERM a scheduler stops within SCHEDULER_STOP_DEADLINE_S (deploy/signals.py); a preStop pause first lets the
Service drop the pod so new requests go to the other replica.
"""
from __future__ import annotations

import math

from epdserve.deploy.local.signals import SCHEDULER_STOP_DEADLINE_S
from epdserve.deploy.kube import pod
from epdserve.deploy.kube.meta import labels, metadata, scheduler_internal_name, scheduler_name
from epdserve.deploy.kube.secrets import API_KEY, CLUSTER_TOKEN, MEDIA_KEY_SECRET, METRICS_TOKEN, secret_env
from epdserve.deploy.kube.values import KubeValues

COMPONENT = "scheduler"
PRE_STOP_S = 5  # the Service's endpoints drop a terminating pod within a few seconds
CPU, MEMORY = "2", "4Gi"


def scheduler_args(v: KubeValues) -> list[str]:
    p = v.ports
    return ["scheduler", "--model", v.model, "--mode", v.mode,
            "--host", "0.0.0.0", "--port", str(p.scheduler), "--http-port", str(p.http), "--metrics-auth", "on",
            "--internal-host", f"$({pod.POD_IP})", "--internal-port", str(p.internal)]


def scheduler_container(v: KubeValues) -> dict:
    p = v.ports
    return {
        "name": COMPONENT, "image": v.image_ref, "imagePullPolicy": v.image_pull_policy,
        "command": list(v.flavour_spec.command), "args": scheduler_args(v),
        "env": [*pod.downward_env(), secret_env(v, CLUSTER_TOKEN), secret_env(v, API_KEY),
                secret_env(v, MEDIA_KEY_SECRET), secret_env(v, METRICS_TOKEN)],
        "ports": [{"name": "grpc", "containerPort": p.scheduler}, {"name": "http", "containerPort": p.http},
                  {"name": "internal", "containerPort": p.internal}],
        **pod.probes(p.scheduler, startup_s=120),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_S}}},
        "resources": pod.resources(CPU, MEMORY),
        "securityContext": pod.container_security(),
        "volumeMounts": pod.model_mounts(),
    }


def grace_seconds() -> int:
    return PRE_STOP_S + math.ceil(SCHEDULER_STOP_DEADLINE_S) + 5


def objects(v: KubeValues) -> list[dict]:
    name, sel = scheduler_name(v), labels(v, COMPONENT)
    p = v.ports
    spread = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": sel}}]
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(v, name, COMPONENT),
           "spec": {"replicas": v.scheduler_replicas, "serviceName": scheduler_internal_name(v),
                    "podManagementPolicy": "Parallel", "selector": {"matchLabels": sel},
                    "template": {"metadata": {"labels": sel},
                                 "spec": pod.pod_spec(v, [scheduler_container(v)], grace_seconds(),
                                                      topologySpreadConstraints=spread)}}}
    public = {"apiVersion": "v1", "kind": "Service", "metadata": metadata(v, name, COMPONENT),
              "spec": {"type": "ClusterIP", "selector": sel,
                       "ports": [{"name": "grpc", "port": p.scheduler, "targetPort": "grpc", "appProtocol": "grpc"},
                                 {"name": "http", "port": p.http, "targetPort": "http", "appProtocol": "http"}]}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": metadata(v, scheduler_internal_name(v), COMPONENT),
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": sel,
                         "ports": [{"name": "internal", "port": p.internal, "targetPort": "internal",
                                    "appProtocol": "grpc"}]}}
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata(v, name, COMPONENT),
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": sel}}}
    return [sts, public, headless, pdb]
