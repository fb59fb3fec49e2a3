"""NetworkPolicies: only the release's own pods reach its internal ports; clients reach the
scheduler's public ports.

- `<release>-internal` selects every pod of the release and admits traffic from pods of the
  same release only, on every port: the scheduler's Registry, instances' gRPC and KV
  rendezvous, the P-D pairs' gloo / NCCL / HCCL sockets (ports they pick at run time), the MM Store;
- `<release>-public` admits anyone to the scheduler pods' public gRPC and HTTP ports (the API key
  guards them; /metrics too, `--metrics-auth on`).

Policies add up, so a scheduler pod takes both. Ingress only: an external MM Store is reached
by egress, which is not restricted. The kubelet's probes come from the node, which the
common CNIs (Calico, Cilium) always admit.
"""
from __future__ import annotations

from epdserve.deploy.kube.meta import labels, metadata, release_labels
from epdserve.deploy.kube.values import KubeValues


def objects(v: KubeValues) -> list[dict]:
    own = {"matchLabels": release_labels(v)}
    internal = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": metadata(v, f"{v.release}-internal", "network"),
                "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": own}]}]}}
    public = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": metadata(v, f"{v.release}-public", "network"),
              "spec": {"podSelector": {"matchLabels": labels(v, "scheduler")}, "policyTypes": ["Ingress"],
                       "ingress": [{"ports": [{"protocol": "TCP", "port": v.ports.scheduler},
                                              {"protocol": "TCP", "port": v.ports.http}]}]}}
    return [internal, public]
