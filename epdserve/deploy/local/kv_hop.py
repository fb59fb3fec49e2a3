"""Which hop a deployment's P→D KV pairs use (`epdserve instance --kv-hop`), decided by the launcher.

Owns `choose_kv_hop`: a mode whose prefill and decode run in separate instances (P-D, EP-D, ED-P,
E-P-D) has KV pairs; the launcher knows which accelerator each instance gets (its visible-devices
variable, `deployment.instance_device_env`), so it knows when a P and a D share one, where NCCL
cannot pair them (it refuses two ranks on one device). Then every instance gets `--kv-hop host`
(gloo between host buffers: transfer/kv/host_hop.py); otherwise the device's own backend. An
explicit `--kv-hop device|host` among the instance flags wins. Pure: the caller passes the roles
and device ids in start order.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.deploy.local.argv import last_flag
from epdserve.roles import role_set


@dataclass(frozen=True)
class KvHopChoice:
    """hop: "device" | "host" | "none" (no P→D pair in this mode); why: one line for the log;
    forced: the flag to add to every instance's argv (None: nothing to add)."""

    hop: str
    why: str
    forced: str | None = None


def is_prefill_side(roles: str) -> bool:
    return role_set(roles).sends_kv


def is_decode_side(roles: str) -> bool:
    return role_set(roles).receives_kv


def choose_kv_hop(roles: list[str], device_ids: list[str | None], device: str,
                  instance_args: list[str]) -> KvHopChoice:
    """The hop of a deployment whose k-th instance (start order) runs `roles[k]` on accelerator(s)
    `device_ids[k]` ("0", a tensor-parallel group "2,3"; None: not known / CPU)."""
    if not any(is_prefill_side(r) for r in roles) or not any(is_decode_side(r) for r in roles):
        return KvHopChoice("none", "no P->D KV pairs in this mode")
    given = last_flag(instance_args, "--kv-hop")
    if given in ("device", "host"):
        return KvHopChoice(given, "--kv-hop given")
    kind = device.split(":")[0]
    if kind == "cpu":
        return KvHopChoice("device", "cpu: gloo between the KV blocks")
    # a tensor-parallel instance's id is its group ("2,3"): a P and a D share a device when their groups meet
    prefill = {x for r, d in zip(roles, device_ids) if is_prefill_side(r) and d is not None for x in d.split(",")}
    decode = {x for r, d in zip(roles, device_ids) if is_decode_side(r) and d is not None for x in d.split(",")}
    shared = sorted(prefill & decode)
    if shared:
        return KvHopChoice("host", f"a P and a D share {kind} device {','.join(shared)}: the device's backend cannot "
                                   f"pair two ranks on one device, so KV is staged through host memory (gloo)",
                           forced="host")
    return KvHopChoice("device", f"every P and D on its own {kind} device")
