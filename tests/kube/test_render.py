"""The rendered manifests of every mode x flavour: valid against a pinned Kubernetes schema,
every container command parses with epdserve's own CLI, every Secret and variable it references
exists, and the issue's requirements hold (scheduler replicas and budget, a Deployment per pool
with one accelerator, downward API, probes, grace period, network policy)."""
from __future__ import annotations

import pytest
import kubernetes_validate

from epdserve.deploy.local.signals import INSTANCE_STOP_MARGIN_S, SCHEDULER_STOP_DEADLINE_S
from epdserve.entrypoints.cli import build_parser
from epdserve.instance.modes import mode_pools
from epdserve.deploy.kube.podview import container_argv, container_env, references
from epdserve.deploy.kube.render import containers, pod_templates, render, to_yaml
from epdserve.deploy.kube.secrets import SECRET_ENV
from epdserve.deploy.kube.values import KubeValues
from tests.kube.conftest import CASES, values_for

K8S_VERSION = "1.33.0"  # the schema pinned (kubernetes-validate ships it; nothing is downloaded)
# Custom resources: their operators' CRDs are not in Kubernetes' schema; checked by shape below.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
FIELDS = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}


def kinds(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def secrets_of(objs) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o["stringData"] for o in kinds(objs, "Secret")}


@pytest.mark.parametrize("mode,flavour", CASES)
def test_every_object_validates_against_the_pinned_schema(rendered, mode, flavour):
    for obj in rendered[mode, flavour]:
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("mode,flavour", CASES)
def test_every_container_command_parses_with_epdserves_cli(rendered, mode, flavour):
    objs = rendered[mode, flavour]
    for obj, c in containers(objs):
        if c["name"] == "redis":
            continue
        env = container_env(c, FIELDS, secrets_of(objs))
        argv = container_argv(c, env)
        assert argv[:len(values_for(mode, flavour).flavour_spec.command)] == c["command"]
        words = argv[len(c["command"]):]
        args = build_parser(words).parse_args(words)  # SystemExit on an unknown or malformed flag
        assert args.func is not None, obj["metadata"]["name"]


@pytest.mark.parametrize("mode,flavour", CASES)
def test_every_secret_and_variable_referenced_exists(rendered, mode, flavour):
    objs = rendered[mode, flavour]
    secrets = secrets_of(objs)
    assert set(secrets) == {values_for(mode, flavour).secret_name}
    for obj, c in containers(objs):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets.get(ref["name"], {}), (obj["metadata"]["name"], ref)
        defined = {e["name"] for e in c.get("env", [])}
        for word in [*c.get("command", []), *c.get("args", [])]:
            assert set(references(word)) <= defined, (obj["metadata"]["name"], word)
    for sm in kinds(objs, "ServiceMonitor"):
        cred = sm["spec"]["endpoints"][0]["authorization"]["credentials"]
        assert cred["key"] in secrets[cred["name"]]


@pytest.mark.parametrize("mode,flavour", CASES)
def test_no_secret_value_is_in_a_command_line(rendered, mode, flavour):
    objs = rendered[mode, flavour]
    values = [v for s in secrets_of(objs).values() for v in s.values()]
    for obj, c in containers(objs):
        line = " ".join(container_argv(c, container_env(c, FIELDS, secrets_of(objs))))
        assert not any(v in line for v in values), obj["metadata"]["name"]
        assert "password" not in " ".join(c.get("args", [])).lower() or c["name"] == "redis"


@pytest.mark.parametrize("mode,flavour", CASES)
def test_one_deployment_per_pool_of_the_mode_each_with_one_accelerator(rendered, mode, flavour):
    v = values_for(mode, flavour)
    deps = kinds(rendered[mode, flavour], "Deployment")
    want = {p.roles: p.count for p in mode_pools(mode, v.encode, v.prefill, v.decode)}
    got = {d["metadata"]["annotations"]["epdserve.io/roles"]: d["spec"]["replicas"] for d in deps}
    assert got == want
    for d in deps:
        c = d["spec"]["template"]["spec"]["containers"][0]
        limits = c["resources"]["limits"]
        if v.resource:
            assert limits[v.resource] == "1"
        assert "--roles" in c["args"] and c["args"][c["args"].index("--device") + 1] == v.flavour_spec.device
    pdbs = {p["metadata"]["name"] for p in kinds(rendered[mode, flavour], "PodDisruptionBudget")}
    assert {d["metadata"]["name"] for d in deps} <= pdbs
    scaled = kinds(rendered[mode, flavour], "ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == {d["metadata"]["name"] for d in deps}
    for s in scaled:
        assert "epdserve:" in s["spec"]["triggers"][0]["metadata"]["query"]


@pytest.mark.parametrize("flavour", ["cpu", "cuda", "ascend"])
def test_scheduler_replicas_services_budget_and_instances_register_with_each(rendered, flavour):
    objs = rendered["E-P-D", flavour]
    v = values_for("E-P-D", flavour)
    (sts,) = [s for s in kinds(objs, "StatefulSet") if s["metadata"]["name"].endswith("-scheduler")]
    assert sts["spec"]["replicas"] >= 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
    services = {s["metadata"]["name"]: s for s in kinds(objs, "Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert f"{v.release}-scheduler" in services
    assert any(p["metadata"]["name"] == sts["metadata"]["name"] for p in kinds(objs, "PodDisruptionBudget"))
    for d in kinds(objs, "Deployment"):
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        listed = args[args.index("--scheduler") + 1].split(",")
        assert listed == [f"{sts['metadata']['name']}-{i}.{headless['metadata']['name']}:{v.ports.internal}"
                          for i in range(sts["spec"]["replicas"])]


@pytest.mark.parametrize("mode,flavour", CASES)
def test_probes_grace_and_downward_api(rendered, mode, flavour):
    v = values_for(mode, flavour)
    for obj, spec in pod_templates(rendered[mode, flavour]):
        c = spec["containers"][0]
        if c["name"] == "redis":
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in c[probe], (obj["metadata"]["name"], probe)
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        if c["name"] == "instance":
            assert spec["terminationGracePeriodSeconds"] >= v.drain_timeout + INSTANCE_STOP_MARGIN_S
            assert c["args"][c["args"].index("--drain-timeout") + 1] == f"{v.drain_timeout:g}"
            if flavour == "ascend":
                assert env["HCCL_IF_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        else:
            pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert spec["terminationGracePeriodSeconds"] >= pre_stop + SCHEDULER_STOP_DEADLINE_S


def test_network_policy_admits_only_the_release_to_internal_ports(rendered):
    objs = rendered["E-P-D", "cpu"]
    v = values_for("E-P-D", "cpu")
    pols = {p["metadata"]["name"]: p["spec"] for p in kinds(objs, "NetworkPolicy")}
    internal = pols[f"{v.release}-internal"]
    release = {"app.kubernetes.io/name": "epdserve", "app.kubernetes.io/instance": v.release}
    assert internal["podSelector"]["matchLabels"] == release
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    public = pols[f"{v.release}-public"]
    assert public["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"
    assert {p["port"] for p in public["ingress"][0]["ports"]} == {v.ports.scheduler, v.ports.http}
    for _, spec in pod_templates(objs):  # every pod falls under the internal policy
        labels = next(o for o, s in pod_templates(objs) if s is spec)["spec"]["template"]["metadata"]["labels"]
        assert release.items() <= labels.items()


def test_custom_resources_have_the_fields_their_operators_need(rendered):
    objs = rendered["EP-D", "ascend"]
    (sm,) = kinds(objs, "ServiceMonitor")
    ep = sm["spec"]["endpoints"][0]
    assert ep["port"] == "http" and ep["path"] == "/metrics" and ep["honorLabels"] is True
    svc = next(s for s in kinds(objs, "Service") if s["metadata"]["labels"] == sm["spec"]["selector"]["matchLabels"]
               and any(p["name"] == "http" for p in s["spec"]["ports"]))
    assert svc["spec"]["type"] == "ClusterIP"
    for so in kinds(objs, "ScaledObject"):
        trig = so["spec"]["triggers"][0]
        assert trig["type"] == "prometheus" and {"serverAddress", "query", "threshold"} <= trig["metadata"].keys()
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]


def test_external_mm_store_and_secret_apart():
    v = KubeValues(mode="P-D", mm_store="rediss://redis.example:6380/0")
    objs = render(v)
    assert not kinds(objs, "Secret") and not any(o["metadata"]["name"].endswith("mm-store") for o in objs)
    refs = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for _, c in containers(objs) for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {(v.secret_name, key) for key in SECRET_ENV.values()}
    for d in kinds(objs, "Deployment"):
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--mm-store") + 1] == "rediss://redis.example:6380/0"


def test_one_dtype_for_every_instance_when_given_else_each_pod_resolves_auto():
    def instance_args(v):
        return [d["spec"]["template"]["spec"]["containers"][0]["args"] for d in kinds(render(v), "Deployment")
                if "instance" in d["spec"]["template"]["spec"]["containers"][0]["args"]]

    given = instance_args(KubeValues(mode="E-P-D", dtype="bfloat16"))
    assert len(given) == 3 and all(a[a.index("--dtype") + 1] == "bfloat16" for a in given)
    assert not any("--dtype" in a for a in instance_args(KubeValues(mode="E-P-D")))


def test_a_tensor_parallel_instance_pod_requests_one_accelerator_per_rank():
    """Issue 48 item 1: --tensor-parallel-size N on every instance that holds the language model and N
    accelerators per such pod; E-only pods their own degree (1 by default)."""
    def pods(**kw):
        return _instance_pods(KubeValues(mode="E-PD", flavour="cuda", **kw))

    assert pods(tensor_parallel_size=2) == {"E": ("1", "1", "1"), "PD": ("2", "2", "2")}
    assert pods(tensor_parallel_size=4, encode_tensor_parallel_size=2) == {"E": ("2", "2", "2"), "PD": ("4", "4", "4")}
    assert pods() == {"E": ("1", "1", "1"), "PD": ("1", "1", "1")}
    assert _instance_pods(KubeValues(mode="P-D", flavour="cuda", tensor_parallel_size=2)) == {
        "P+E": ("2", "2", "2"), "D": ("2", "2", "2")}  # a split pool too: the KV hop carries any pair


def _instance_pods(v: KubeValues) -> dict[str, tuple[str, str, str]]:
    """{roles: (--tensor-parallel-size, accelerators limited, accelerators requested)} of every instance pod."""
    out = {}
    for _, c in containers(render(v)):
        if c["name"] == "instance":
            args = c["args"]
            degree = args[args.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in args else "1"
            out[args[args.index("--roles") + 1]] = (degree, c["resources"]["limits"][v.resource],
                                                    c["resources"]["requests"][v.resource])
    return out


def test_prefill_and_decode_pods_request_their_own_degree():
    """Issue 48 item 1: prefill_tensor_parallel_size / decode_tensor_parallel_size (0: tensor_parallel_size)
    give the P and D pods their degree and as many accelerators; PD pods keep tensor_parallel_size."""
    pods = _instance_pods(KubeValues(mode="E-P-D", flavour="ascend", prefill_tensor_parallel_size=2,
                                     decode_tensor_parallel_size=4))
    assert pods == {"E": ("1", "1", "1"), "P": ("2", "2", "2"), "D": ("4", "4", "4")}
    pods = _instance_pods(KubeValues(mode="ED-P", flavour="cuda", tensor_parallel_size=2,
                                     decode_tensor_parallel_size=4))
    assert pods == {"ED": ("4", "4", "4"), "P": ("2", "2", "2")}
    pods = _instance_pods(KubeValues(mode="E-PD", flavour="cuda", tensor_parallel_size=2,
                                     prefill_tensor_parallel_size=4, decode_tensor_parallel_size=8))
    assert pods == {"E": ("1", "1", "1"), "PD": ("2", "2", "2")}


def test_render_refuses_a_negative_stage_degree():
    with pytest.raises(ValueError, match="decode_tensor_parallel_size must be >= 0"):
        KubeValues(mode="E-P-D", decode_tensor_parallel_size=-1)


@pytest.mark.parametrize("url", ["redis://:secret@r:6379/0", "redis://u:secret@r:6379", "redis://r/0?password=x",
                                 "http://r:6379"])
def test_a_password_in_the_mm_store_url_is_refused(url):
    with pytest.raises(ValueError):
        KubeValues(mm_store=url)


def test_a_pvc_model_replaces_the_demo_init_container():
    objs = render(KubeValues(mode="E-PD", flavour="cuda", model_pvc="qwen", model_path="Qwen2-VL-7B-Instruct"))
    for _, spec in pod_templates(objs):
        if spec["containers"][0]["name"] == "redis":
            continue
        assert "initContainers" not in spec
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "qwen", "readOnly": True}} in spec["volumes"]
        assert "/models/Qwen2-VL-7B-Instruct" in spec["containers"][0]["args"]


def test_cli_renders_yaml(tmp_path):
    import yaml

    from epdserve.entrypoints.cli import main

    out = tmp_path / "m.yaml"
    assert main(["k8s", "render", "--mode", "EP-D", "--flavour", "ascend", "--out", str(out)]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    assert docs == render(KubeValues(mode="EP-D", flavour="ascend"))
    assert "&id" not in to_yaml(docs)


def test_the_committed_example_is_what_the_renderer_writes():
    """deploy/kubernetes/E-P-D-cpu.yaml: `epdserve k8s render --mode E-P-D --flavour cpu`, kept
    equal so that it can be applied without epdserve installed (regenerate with that command)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "E-P-D-cpu.yaml"
    assert path.read_text() == to_yaml(render(KubeValues(mode="E-P-D", flavour="cpu"))), \
        f"regenerate: epdserve k8s render --mode E-P-D --flavour cpu --out {path.relative_to(path.parents[2])}"
