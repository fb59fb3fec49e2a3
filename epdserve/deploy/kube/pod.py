"""The parts every epdserve pod shares: security contexts, the model volume (a PVC, or a demo
checkpoint that an init container writes), the downward-API environment, gRPC probes.

An epdserve process learns its own address from `POD_IP` (downward API `status.podIP`) and is
given it as `$(POD_IP)` in its args, which the kubelet expands from the container's env; secrets
come only from the Secret through env (`secrets.py`). Probes are the kubelet's own gRPC probe
against grpc.health.v1, which every epdserve server answers without credentials.
"""
from __future__ import annotations

from epdserve.deploy.kube.values import KubeValues

UID = 10001  # the image's `epdserve` user (deploy/docker/)
MODEL_VOLUME = "models"
TMP_VOLUME = "tmp"
POD_IP = "POD_IP"


def pod_security_plain() -> dict:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def pod_security(v: KubeValues) -> dict:
    ctx = pod_security_plain()
    groups = v.flavour_spec.supplemental_groups
    if groups:
        ctx["supplementalGroups"] = list(groups)
    return ctx


def container_security() -> dict:
    # readOnlyRootFilesystem stays false: torch's C++-extension loader takes a lock file and
    # rewrites build.ninja in the operators' build folder (built into the image by
    # `epdserve build-ops`) even when the library is already built.
    return {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": False,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def downward_env() -> list[dict]:
    return [field_env(POD_IP, "status.podIP"), field_env("POD_NAME", "metadata.name")]


def grpc_probe(port: int, period_s: int, failures: int, timeout_s: int = 5) -> dict:
    return {"grpc": {"port": port}, "periodSeconds": period_s, "failureThreshold": failures,
            "timeoutSeconds": timeout_s}


def probes(port: int, startup_s: int) -> dict:
    """startup (model load), then readiness and liveness, all grpc.health.v1 on `port`."""
    period = 5
    return {"startupProbe": grpc_probe(port, period, max(1, startup_s // period)),
            "readinessProbe": grpc_probe(port, period, 2),
            "livenessProbe": grpc_probe(port, 10, 3)}


def resources(cpu: str, memory: str, extra: dict[str, int] | None = None) -> dict:
    limits = {"cpu": cpu, "memory": memory, **{k: str(n) for k, n in (extra or {}).items()}}
    return {"requests": dict(limits), "limits": limits}


def model_mounts() -> list[dict]:
    return [{"name": MODEL_VOLUME, "mountPath": "/models", "readOnly": True},
            {"name": TMP_VOLUME, "mountPath": "/tmp"}]


def volumes(v: KubeValues) -> list[dict]:
    model = ({"name": MODEL_VOLUME, "emptyDir": {}} if v.demo_model else
             {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": v.model_pvc, "readOnly": True}})
    return [model, {"name": TMP_VOLUME, "emptyDir": {}}]


def init_containers(v: KubeValues) -> list[dict]:
    """The demo checkpoint, written into the pod's `models` volume (the same seed on every pod
    gives identical files: `epdserve demo-model`)."""
    if not v.demo_model:
        return []
    return [{"name": "demo-model", "image": v.image_ref, "imagePullPolicy": v.image_pull_policy,
             "command": list(v.flavour_spec.command),
             "args": ["demo-model", v.model, "--size", v.demo_size],
             "securityContext": container_security(),
             "resources": resources("1", "2Gi"),
             "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": "/models"}, {"name": TMP_VOLUME, "mountPath": "/tmp"}]}]


def pod_spec(v: KubeValues, containers: list[dict], grace_s: int, **extra) -> dict:
    spec = {"automountServiceAccountToken": False, "securityContext": pod_security(v),
            "terminationGracePeriodSeconds": grace_s, "initContainers": init_containers(v),
            "containers": containers, "volumes": volumes(v), **extra}
    if not spec["initContainers"]:
        del spec["initContainers"]
    return spec
