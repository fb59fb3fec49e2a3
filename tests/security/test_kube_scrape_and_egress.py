"""Kubernetes (issue 39): Prometheus scrapes /metrics with a token of its own, never the clients'
API key (which anyone reading the scrape configuration could then use to send requests), and
every pod of a release may reach only the release, the cluster DNS and an external MM Store's
port (no cloud metadata, no other workloads, no internet). On today's main the ServiceMonitor
reads the Secret's `api-key` and no egress is restricted."""
from __future__ import annotations

from epdserve.deploy.kube.render import render
from epdserve.deploy.kube.values import KubeValues


def _kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def test_the_service_monitor_scrapes_with_its_own_token():
    v = KubeValues(mode="E-P-D", flavour="cpu")
    objs = render(v)
    [monitor] = _kind(objs, "ServiceMonitor")
    creds = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert creds == {"name": v.secret_name, "key": "metrics-token"}
    schedulers = [o for o in _kind(objs, "StatefulSet") if o["metadata"]["name"].endswith("scheduler")]
    env = {e["name"]: e for e in schedulers[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EPDSERVE_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "metrics-token"


def test_egress_is_the_release_dns_and_the_mm_store_only():
    v = KubeValues(mode="P-D", mm_store="rediss://redis.example:6380/0")
    [policy] = [p for p in _kind(render(v), "NetworkPolicy") if p["metadata"]["name"] == f"{v.release}-egress"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Egress"] and spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"]
    rules = spec["egress"]
    assert rules[0] == {"to": [{"podSelector": spec["podSelector"]}]}
    assert {p["port"] for p in rules[1]["ports"]} == {53} and rules[1]["to"][0]["podSelector"]
    assert rules[2] == {"ports": [{"protocol": "TCP", "port": 6380}]} and len(rules) == 3
    for rule in rules:  # no ipBlock anywhere: nothing beyond these is reachable
        assert all("ipBlock" not in t for t in rule.get("to", []))
