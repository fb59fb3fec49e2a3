"""What the loopback harness (pod_harness.py) changes in a rendered container's argv, and nothing
else: every word of every EP-D container is the pod spec's word but for cluster DNS names, 0.0.0.0
and mount paths. Renders only: no process is started."""
from __future__ import annotations

from pathlib import Path

from epdserve.deploy.kube.podview import container_argv, container_env
from epdserve.deploy.kube.render import containers, render
from epdserve.deploy.kube.values import KubeValues
from tests.kube.pod_harness import local_rewrites, loopback_ports

DNS = {"epdserve-scheduler-0.epdserve-scheduler-internal": "127.9.9.3",
       "epdserve-scheduler-1.epdserve-scheduler-internal": "127.9.9.4", "epdserve-mm-store": "127.9.9.2"}
MOUNTS = {"/models": Path("/node/models"), "/tmp": Path("/node/pod/tmp"), "/run/redis": Path("/node/pod/conf")}


def test_only_names_binds_and_mounts_differ():
    v = KubeValues(mode="EP-D", flavour="cpu", secrets="generate", ports=loopback_ports())
    objs = render(v)
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objs if o["kind"] == "Secret"}
    p = v.ports
    for _, c in containers(objs):
        env = container_env(c, {"status.podIP": "127.9.9.7", "metadata.name": "pod-0"}, secrets)
        spec = container_argv(c, env)
        local = local_rewrites(spec, dns=DNS, pod_ip="127.9.9.7", mounts=MOUNTS)
        changed = {a: b for a, b in zip(spec, local) if a != b}
        assert len(local) == len(spec)
        assert len(changed) == {"redis": 1, "demo-model": 1, "scheduler": 2, "instance": 3}[c["name"]], changed
        for a, b in changed.items():
            if c["name"] == "redis":
                assert b == a.replace("/run/redis/", "/node/pod/conf/")
            elif a == "0.0.0.0":
                assert b == "127.9.9.7"
            elif a.startswith("/models/"):
                assert b == "/node/models/" + a.removeprefix("/models/")
            elif a.startswith("redis://"):
                assert (a, b) == (f"redis://epdserve-mm-store:{p.mm_store}/0", f"redis://127.9.9.2:{p.mm_store}/0")
            else:
                assert (a, b) == (f"epdserve-scheduler-0.epdserve-scheduler-internal:{p.internal},"
                                  f"epdserve-scheduler-1.epdserve-scheduler-internal:{p.internal}",
                                  f"127.9.9.3:{p.internal},127.9.9.4:{p.internal}")


def test_a_rewritten_path_is_not_rewritten_again():
    # /models -> a folder under /tmp, and /tmp is itself a mount: one pass, so the result stands
    assert local_rewrites(["--model", "/models/demo", "/tmp", "/tmpx", "a/models/b"], dns={}, pod_ip="",
                          mounts={"/models": Path("/tmp/n/models"), "/tmp": Path("/p/tmp")}) == \
        ["--model", "/tmp/n/models/demo", "/p/tmp", "/tmpx", "a/models/b"]
