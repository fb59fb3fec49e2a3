"""NetworkPolicies: only the release's own pods reach its internal ports; clients reach the
scheduler's public ports.

- `<release>-internal` selects every pod of the release and admits traffic from pods of the
  same release only, on every port: the scheduler's Registry, instances' gRPC and KV
  rendezvous, the P-D pairs' gloo / NCCL / HCCL sockets (ports they pick at run time), the MM Store;
- `<release>-public` admits anyone to the scheduler pods' public gRPC and HTTP ports (the API key
  guards them; /metrics too, `--metrics-auth on`).

- `<release>-egress` lets every pod of the release reach only the release's own pods, the
  cluster DNS (port 53, kube-dns / CoreDNS pods) and, with an external MM Store, that store's
  port: a compromised pod cannot reach the cloud metadata service, other workloads or the
  internet (the scheduler fetches no remote images here: the renderer does not pass
  --allow-remote-images).

Policies add up, so a scheduler pod takes the first two. The kubelet's probes come from the node,
which the common CNIs (Calico, Cilium) always admit.
"""
from __future__ import annotations

from urllib.parse import urlsplit

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
    egress = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": metadata(v, f"{v.release}-egress", "network"),
              "spec": {"podSelector": own, "policyTypes": ["Egress"], "egress": egress_rules(v, own)}}
    return [internal, public, egress]


def egress_rules(v: KubeValues, own: dict) -> list[dict]:
    dns = {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
           "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    rules = [{"to": [{"podSelector": own}]}, dns]
    if v.mm_store is not None:
        rules.append({"ports": [{"protocol": "TCP", "port": urlsplit(v.mm_store).port or 6379}]})
    return rules
