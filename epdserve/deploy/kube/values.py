"""`KubeValues`: every choice a rendered deployment makes, validated once; its fields are the
`epdserve k8s render` flags (epdserve/settings.py).

The mode and its per-role counts are `epdserve launch`'s (`instance/modes.py` sizes the pools);
the flavour picks the device, resource and image (`flavours.py`); the rest names the release,
the model's volume, the MM Store, the secrets and the autoscaling.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from epdserve.engine.config import EngineConfig
from epdserve.instance.modes import MODES, Pool, mode_pools, pool_degrees
from epdserve.deploy.kube.flavours import FLAVOURS, Flavour, get_flavour
from epdserve.deploy.kube.ports import Ports
from epdserve.settings import check_settings, same_as, setting

SECRETS = ("external", "generate")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass
class KubeValues:
    mode: str = setting("E-P-D", choices=MODES, help="deployment mode (instance/modes.py)")
    encode: int = setting(1, help="E instances of the mode (as `epdserve launch --encode`)")
    prefill: int = setting(1, help="P instances of the mode (as `epdserve launch --prefill`)")
    decode: int = setting(1, help="D instances of the mode (as `epdserve launch --decode`)")
    flavour: str = setting("cpu", choices=tuple(FLAVOURS), help="cpu (try-out), cuda or ascend")
    release: str = setting("epdserve", help="release name: prefix of every object and the label that the "
                                            "NetworkPolicy admits")
    namespace: str = setting("epdserve", help="namespace of every object")
    image: str | None = setting(None, help="container image (default: the flavour's, epdserve:<flavour>, built from "
                                           "deploy/docker/); pin a digest (repo@sha256:...) in production")
    image_pull_policy: str = setting("IfNotPresent", choices=("IfNotPresent", "Always", "Never"),
                                     help="imagePullPolicy of every epdserve container")
    model_pvc: str | None = setting(None, help="PersistentVolumeClaim holding the checkpoint, mounted read-only at "
                                               "/models (default: a demo checkpoint written by an init container)")
    model_path: str = setting("demo", help="the checkpoint's folder under /models")
    demo_size: str = setting("tiny", choices=("tiny", "small"), help="without --model-pvc: the demo checkpoint's size")
    mm_store: str | None = setting(None, help="MM Store URL of an external Redis, WITHOUT a password (its password "
                                              "is the Secret's mm-store-password); default: a one-replica Redis "
                                              "StatefulSet of the release, for trying out")
    mm_store_image: str = setting("redis:7.4.2-alpine", help="image of the try-out Redis")
    secrets: str = setting("external", choices=SECRETS,
                           help="external: the Secret <release>-secrets is created apart (kubectl create secret, "
                                "README); generate: render it with random values (first install only: a re-apply "
                                "would change them)")
    scheduler_replicas: int = setting(2, help="scheduler replicas (a StatefulSet; every instance registers with each)")
    drain_timeout: float = setting(30.0, help="an instance's --drain-timeout (seconds): calls in flight finish on "
                                              "SIGTERM; terminationGracePeriodSeconds covers it")
    kv_cache_bytes: int | None = same_as(  # not given: the flavour's, else the instance's own default
        EngineConfig, "kv_cache_bytes", default=None,
        help="an instance's KV cache size per P/D worker, MiB (default: the flavour's: 16384 on an accelerator; "
             "the instance's own on CPU)")
    tensor_parallel_size: int = same_as(
        EngineConfig, "tensor_parallel_size",
        help="the --tensor-parallel-size of the instances that hold the language model (those that prefill and "
             "decode; the prefill-only and decode-only ones too unless their own degree is given); each such pod "
             "then requests that many accelerators (rank r on the r-th the device plugin gives it)")
    encode_tensor_parallel_size: int = setting(
        1, check=(">=", 1), help="the E-only instances' --tensor-parallel-size and accelerators per pod (E scales "
                                 "by replicas at 1: `epdserve launch --encode-tensor-parallel-size`)")
    prefill_tensor_parallel_size: int = setting(
        0, check=(">=", 0), help="the prefill-only instances' (P, EP, P+E) --tensor-parallel-size and accelerators "
                                 "per pod; 0: tensor_parallel_size (`epdserve launch "
                                 "--prefill-tensor-parallel-size`); with the decode degree, a pair the P->D KV hop "
                                 "carries, else render refuses")
    decode_tensor_parallel_size: int = setting(
        0, check=(">=", 0), help="the decode-only instances' (D, ED) --tensor-parallel-size and accelerators per "
                                 "pod; 0: tensor_parallel_size (`epdserve launch --decode-tensor-parallel-size`)")
    dtype: str | None = same_as(
        EngineConfig, "dtype", help="every instance's --dtype (default: not passed: each pod resolves auto on its "
                                    "node — bf16 on an accelerator or a CPU with AVX512-BF16/AMX-BF16, else fp32; "
                                    "give one where nodes differ, since the scheduler refuses mixed dtypes)")
    accelerator_resource: str | None = setting(
        None, help="the device plugin's resource each instance requests (default: the flavour's: nvidia.com/gpu, "
                   "huawei.com/Ascend910)")
    startup_seconds: int = setting(900, help="how long an instance may take to load its model before the kubelet "
                                             "restarts it (startupProbe)")
    autoscale: bool = setting(True, negate="--no-autoscale", help="no KEDA ScaledObjects")
    max_replicas: int = setting(4, help="KEDA: most replicas of one role")
    scale_waiting: int = setting(4, help="KEDA: target epdserve:instance_waiting_requests per replica of a role")
    prometheus_url: str = setting("http://prometheus-operated.monitoring.svc:9090",
                                  help="KEDA's Prometheus (the server that scrapes the ServiceMonitor)")
    service_monitor: bool = setting(True, negate="--no-service-monitor", help="no ServiceMonitor (no Prometheus "
                                                                               "Operator)")
    ports: Ports = field(default_factory=Ports)

    def __post_init__(self):
        for name in ("release", "namespace"):
            if not _DNS_LABEL.match(getattr(self, name)) or len(getattr(self, name)) > 40:
                raise ValueError(f"{name} must be a DNS label of at most 40 characters, got {getattr(self, name)!r}")
        get_flavour(self.flavour)
        self.pools  # ValueError for counts the mode cannot run
        if self.scheduler_replicas < 1:
            raise ValueError(f"scheduler_replicas must be >= 1, got {self.scheduler_replicas}")
        if self.drain_timeout < 0 or self.startup_seconds < 10:
            raise ValueError("drain_timeout must be >= 0 and startup_seconds >= 10")
        if self.max_replicas < 1 or self.scale_waiting < 1:
            raise ValueError("max_replicas and scale_waiting must be >= 1")
        check_settings(self)
        self.degrees  # ValueError for a P->D pair of degrees the KV hop does not carry
        if self.model_path.startswith("/") or ".." in self.model_path.split("/"):
            raise ValueError(f"model_path is a folder under /models, got {self.model_path!r}")
        if self.mm_store is not None:
            check_mm_store_url(self.mm_store)

    @property
    def flavour_spec(self) -> Flavour:
        return get_flavour(self.flavour)

    @property
    def pools(self) -> list[Pool]:
        return mode_pools(self.mode, self.encode, self.prefill, self.decode)

    @property
    def degrees(self) -> dict[str, int]:
        """{roles: --tensor-parallel-size} of every pool, its pods' accelerators too; ValueError for a
        P->D pair of degrees the KV hop does not carry (instance/modes.py `pool_degrees`)."""
        pools = self.pools
        return dict(zip((p.roles for p in pools),
                        pool_degrees(pools, self.tensor_parallel_size, self.encode_tensor_parallel_size,
                                     self.prefill_tensor_parallel_size, self.decode_tensor_parallel_size)))

    @property
    def model(self) -> str:
        return f"/models/{self.model_path}"

    @property
    def demo_model(self) -> bool:
        return self.model_pvc is None

    @property
    def secret_name(self) -> str:
        return f"{self.release}-secrets"

    @property
    def image_ref(self) -> str:
        return self.image or self.flavour_spec.image

    @property
    def kv_cache_mb(self) -> int | None:
        """An instance's --kv-cache-mb; None: not passed (the instance's default applies)."""
        return self.kv_cache_bytes >> 20 if self.kv_cache_bytes is not None else self.flavour_spec.kv_cache_mb

    @property
    def resource(self) -> str | None:
        return self.accelerator_resource or self.flavour_spec.resource


def check_mm_store_url(url: str) -> None:
    """A password in the MM Store URL would be an argument that `ps` shows: refused, as
    scripts/atlas_node.sh refuses it."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"mm_store must be a redis:// or rediss:// URL, got {url!r}")
    if parts.password or "password" in parse_qs(parts.query):
        raise ValueError("mm_store carries a password, which would be in the instances' arguments: leave it out of "
                         "the URL; the Secret's mm-store-password becomes EPDSERVE_MM_STORE_PASSWORD")
