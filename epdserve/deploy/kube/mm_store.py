"""The MM Store for trying out: a one-replica Redis StatefulSet of the release and its Service.

Used when no `--mm-store URL` names an external Redis / Redis Cluster. Its password is the
Secret's `mm-store-password` (the one instances read as EPDSERVE_MM_STORE_PASSWORD): written into
a config file on a memory-backed emptyDir at start, never into redis-server's argv. It keeps
nothing on disk (the MM Store is a cache: a restarted one comes back empty and P recomputes what
it misses) and evicts least-recently-used keys at `MAXMEMORY`.
"""
from __future__ import annotations

from epdserve.deploy.kube import pod
from epdserve.deploy.kube.meta import labels, metadata, mm_store_name
from epdserve.deploy.kube.secrets import MM_STORE_PASSWORD, secret_env
from epdserve.deploy.kube.values import KubeValues

COMPONENT = "mm-store"
MAXMEMORY = "1gb"
CONF_DIR = "/run/redis"
# printf writes the config; the password reaches it through the environment only
_START = ('printf \'requirepass "%s"\\nport %s\\nsave ""\\nappendonly no\\nmaxmemory {maxmemory}\\n'
          'maxmemory-policy allkeys-lru\\n\' "$REDIS_PASSWORD" "$REDIS_PORT" > {conf}/redis.conf '
          '&& exec redis-server {conf}/redis.conf')


def objects(v: KubeValues) -> list[dict]:
    if v.mm_store is not None:
        return []
    name, sel, port = mm_store_name(v), labels(v, COMPONENT), v.ports.mm_store
    container = {
        "name": "redis", "image": v.mm_store_image, "imagePullPolicy": v.image_pull_policy,
        "command": ["sh", "-c", _START.format(maxmemory=MAXMEMORY, conf=CONF_DIR)],
        "env": [secret_env(v, MM_STORE_PASSWORD, "REDIS_PASSWORD"), {"name": "REDIS_PORT", "value": str(port)}],
        "ports": [{"name": "redis", "containerPort": port}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": pod.resources("1", "1536Mi"),
        "securityContext": {**pod.container_security(), "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "conf", "mountPath": CONF_DIR}, {"name": "data", "mountPath": "/data"}],
    }
    spec = {"automountServiceAccountToken": False, "securityContext": pod.pod_security_plain(),
            "containers": [container],
            "volumes": [{"name": "conf", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                        {"name": "data", "emptyDir": {}}]}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(v, name, COMPONENT),
           "spec": {"replicas": 1, "serviceName": name, "selector": {"matchLabels": sel},
                    "template": {"metadata": {"labels": sel}, "spec": spec}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": metadata(v, name, COMPONENT),
           "spec": {"selector": sel, "ports": [{"name": "redis", "port": port, "targetPort": "redis"}]}}
    return [sts, svc]
