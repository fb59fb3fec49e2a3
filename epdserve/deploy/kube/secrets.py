"""The release's one Secret: which key of it becomes which environment variable.

`SECRET_ENV` maps each variable epdserve reads (never a flag: argv is visible in `ps`) to its
key in `<release>-secrets`. `secret(v)` renders that Secret with random values
(`--secrets generate`, a first install); by default it is created apart, by the command that
`create_command(v)` writes (README "Deploy on Kubernetes").
"""
from __future__ import annotations

import secrets as random_secrets

from epdserve.deploy.kube.meta import metadata
from epdserve.deploy.kube.values import KubeValues

CLUSTER_TOKEN = "EPDSERVE_CLUSTER_TOKEN"
API_KEY = "EPDSERVE_API_KEY"
MM_STORE_PASSWORD = "EPDSERVE_MM_STORE_PASSWORD"
MEDIA_KEY_SECRET = "EPDSERVE_MEDIA_KEY_SECRET"  # the scheduler's alone: it keys media (seams/media_keys.py)
METRICS_TOKEN = "EPDSERVE_METRICS_TOKEN"  # /metrics' scrape token: Prometheus holds it, never the clients' API key
SECRET_ENV = {CLUSTER_TOKEN: "cluster-token", API_KEY: "api-key", MM_STORE_PASSWORD: "mm-store-password",
              MEDIA_KEY_SECRET: "media-key-secret", METRICS_TOKEN: "metrics-token"}


def secret_env(v: KubeValues, var: str, name: str | None = None) -> dict:
    """An env entry reading `var`'s key of the release's Secret (named `name` in the container)."""
    return {"name": name or var, "valueFrom": {"secretKeyRef": {"name": v.secret_name, "key": SECRET_ENV[var]}}}


def secret(v: KubeValues) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata(v, v.secret_name, "secrets"),
            "type": "Opaque", "stringData": {key: random_secrets.token_hex(32) for key in SECRET_ENV.values()}}


def create_command(v: KubeValues) -> str:
    literals = " ".join(f'--from-literal={key}="$(openssl rand -hex 32)"' for key in SECRET_ENV.values())
    return f"kubectl -n {v.namespace} create secret generic {v.secret_name} {literals}"
