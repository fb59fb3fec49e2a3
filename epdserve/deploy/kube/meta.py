"""Names and labels of a release's objects, so every selector and reference agrees.

Every object carries `app.kubernetes.io/name: epdserve` and `app.kubernetes.io/instance:
<release>` (the NetworkPolicy admits pods with both), plus a component (`scheduler`,
`instance`, `mm-store`) and, for instances, the role set as a label-safe slug (`P+E` ->
`p-e`; the exact roles string rides in the `epdserve.io/roles` annotation).
"""
from __future__ import annotations

from epdserve.deploy.kube.values import KubeValues

NAME = "epdserve"
ROLES_KEY = "epdserve.io/roles"


def release_labels(v: KubeValues) -> dict[str, str]:
    return {"app.kubernetes.io/name": NAME, "app.kubernetes.io/instance": v.release}


def labels(v: KubeValues, component: str, roles: str | None = None) -> dict[str, str]:
    out = {**release_labels(v), "app.kubernetes.io/component": component}
    if roles is not None:
        out[ROLES_KEY] = role_slug(roles)
    return out


def role_slug(roles: str) -> str:
    return roles.lower().replace("+", "-")


def metadata(v: KubeValues, name: str, component: str, roles: str | None = None) -> dict:
    meta = {"name": name, "namespace": v.namespace, "labels": labels(v, component, roles)}
    if roles is not None:
        meta["annotations"] = {ROLES_KEY: roles}
    return meta


def scheduler_name(v: KubeValues) -> str:
    return f"{v.release}-scheduler"


def scheduler_internal_name(v: KubeValues) -> str:
    """The headless Service that gives each scheduler pod its DNS name."""
    return f"{v.release}-scheduler-internal"


def instance_name(v: KubeValues, roles: str) -> str:
    return f"{v.release}-{role_slug(roles)}"


def mm_store_name(v: KubeValues) -> str:
    return f"{v.release}-mm-store"


def scheduler_addresses(v: KubeValues) -> list[str]:
    """Each scheduler pod's internal address, by its stable StatefulSet DNS name: an instance
    registers with every one (`epdserve instance --scheduler a,b`)."""
    svc = scheduler_internal_name(v)
    return [f"{scheduler_name(v)}-{i}.{svc}:{v.ports.internal}" for i in range(v.scheduler_replicas)]


def mm_store_url(v: KubeValues) -> str:
    return v.mm_store or f"redis://{mm_store_name(v)}:{v.ports.mm_store}/0"
