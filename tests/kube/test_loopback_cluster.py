"""A rendered EP-D release run here without a cluster (issue 29 item 4): every container's own
command as a process on a loopback IP of its own, with the env its pod gets (tests/kube/
pod_harness.py; `local_rewrites` is all that differs from the pod spec). Every pod passes its
kubelet probes, the scheduler Service (both scheduler pods behind one resolver target) serves
greedy outputs equal to transformers' generate, and under steady load a D Deployment scaled from
1 to 2 gives the new pod work, then the old pod killed with SIGKILL is replaced as a Deployment
would (a new pod, new name and IP): no request lost, every output exact."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from epdserve.client import Client, EPDServeError
from epdserve.deploy.kube.meta import instance_name, scheduler_name
from epdserve.deploy.kube.values import KubeValues
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import common_pb2
from tests.harness import wait_until
from tests.instance.harness import PH, image, status, stub
from tests.kube.kubelet_probe import PROBES, probe
from tests.kube.pod_harness import LoopbackCluster, Pod, loopback_ports
from tests.kube.steady_load import Job, SteadyLoad

pytestmark = pytest.mark.slow

MODE = "EP-D"
JOBS = [Job(f"Describe {PH} briefly, picture {k}.", (image(k, 84, 84),), 24) for k in range(6)]


def service_target(c: LoopbackCluster) -> str:
    """The scheduler Service as a client resolves it: one target, every ready scheduler pod."""
    return "ipv4:" + ",".join(c.service_targets())


def instance_id(c: LoopbackCluster, pod: Pod) -> str:
    """The id the pod's instance registered under, asked of the pod itself (with the cluster
    token: a client's ServerInfo shows no instance address)."""
    return status(stub(pod.address, c.secrets[c.values.secret_name]["cluster-token"])).instance_id


def healthy(c: LoopbackCluster) -> list[dict[str, common_pb2.InstanceStatus]]:
    """Each scheduler's healthy instances by id (none from one that does not answer in time)."""
    out = []
    for target in c.service_targets():
        with Client(target, api_key=c.api_key, timeout=30, retries=0) as client:
            try:
                out.append({i.instance_id: i for i in client.server_info().instances if i.health == common_pb2.HEALTHY})
            except EPDServeError:
                out.append({})
    return out


def wait_for(check, timeout_s: float, what: str, c: LoopbackCluster):
    """`tests.harness.wait_until`, with every pod's log tail when it times out."""
    return wait_until(check, timeout_s, what, interval_s=0.25,
                      detail=lambda: "\n".join(f"== {p.name}\n{p.tail(1500)}" for p in c.pods))


def registered(c: LoopbackCluster, ids: set[str]) -> bool:
    return all(ids <= set(seen) for seen in healthy(c))


def instance_pods(c: LoopbackCluster) -> list[Pod]:
    return [p for p in c.pods if p.alive() and p.container["name"] == "instance"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # fp32, the oracle's dtype: the pods' environment has no $EPDSERVE_DTYPE (the image's has none)
    values = KubeValues(mode=MODE, flavour="cpu", secrets="generate", ports=loopback_ports(), dtype="float32")
    with LoopbackCluster(values, tmp_path_factory.mktemp("loopback-cluster")) as c:
        c.start_all()
        ids = {instance_id(c, p) for p in instance_pods(c)}
        wait_for(lambda: registered(c, ids), 240, "every instance healthy on every scheduler", c)
        yield c


@pytest.fixture(scope="module")
def references(cluster) -> list[list[int]]:
    ref = ReferenceGenerator(cluster.models / cluster.values.model_path)
    return [ref.generate(j.prompt, list(j.images), max_tokens=j.max_tokens) for j in JOBS]


def test_every_pod_answers_the_kubelets_probes(cluster):
    assert {p.workload["metadata"]["name"] for p in cluster.pods} == {o["metadata"]["name"]
                                                                      for o in cluster.workloads()}
    for p in cluster.pods:
        kinds = [k for k in PROBES if k in p.container]
        assert "readinessProbe" in kinds and "livenessProbe" in kinds, p.name
        assert all(probe(p.container, p.ip, k) for k in kinds), p.name


def test_the_scheduler_service_serves_exactly(cluster, references):
    assert len(cluster.service_targets()) == cluster.workload(scheduler_name(cluster.values))["spec"]["replicas"]
    with Client(service_target(cluster), api_key=cluster.api_key, timeout=300) as client:
        for job, want in zip(JOBS, references):
            out = client.generate(job.prompt, images=list(job.images), max_tokens=job.max_tokens, temperature=0.0,
                                  ignore_eos=True)
            assert out.token_ids == want


def test_scale_up_and_a_killed_pod_under_load_lose_nothing(cluster, references):
    d = cluster.workload(instance_name(cluster.values, "D"))
    [old] = cluster.pods_of(d["metadata"]["name"])
    old_id = instance_id(cluster, old)
    with SteadyLoad(service_target(cluster), cluster.api_key, JOBS) as load:
        assert load.streaming.wait(120), load.errors
        # scale 1 -> 2: one more pod of the template, ready, registered, and given work
        added = cluster.start_pod(d)
        cluster.wait_ready([added])
        added_id = instance_id(cluster, added)
        wait_for(lambda: (s := healthy(cluster)[0].get(added_id)) is not None and s.load.kv_received_bytes > 0,
                   240, "the added D pod receiving KV", cluster)
        # kill -9 the old pod while it decodes; the Deployment starts a replacement
        wait_for(lambda: (s := healthy(cluster)[0].get(old_id)) is not None and s.load.running_requests > 0,
                   120, "the old D pod decoding", cluster)
        before = load.done
        old.kill()
        replacement = cluster.replace(old)
        assert (replacement.name, replacement.ip) != (old.name, old.ip)
        cluster.wait_ready([replacement])
        now = {added_id, instance_id(cluster, replacement)}
        wait_for(lambda: registered(cluster, now) and load.done > before + 6, 240,
                   "the replacement registered, requests going on", cluster)
    assert not load.errors, load.errors
    assert load.done > before + 6
    for k, ids in load.results:
        assert ids == references[k], f"job {k}"
    assert all(old_id not in s for s in healthy(cluster))


def test_the_service_monitor_scrapes_every_scheduler_pod(cluster):
    """As Prometheus would: each scheduler pod's named `http` port, the ServiceMonitor's path and
    its Bearer credentials from the Secret; refused without them (--metrics-auth on)."""
    [monitor] = [o for o in cluster.objects if o["kind"] == "ServiceMonitor"]
    [endpoint] = monitor["spec"]["endpoints"]
    creds = endpoint["authorization"]["credentials"]
    token = cluster.secrets[creds["name"]][creds["key"]]
    for p in cluster.pods_of(scheduler_name(cluster.values)):
        [port] = [cp["containerPort"] for cp in p.container["ports"] if cp["name"] == endpoint["port"]]
        url = f"{endpoint['scheme']}://{p.ip}:{port}{endpoint['path']}"
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}),
                                    timeout=30) as resp:
            assert resp.status == 200 and b"epdserve" in resp.read()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=30)
        assert refused.value.code == 401
