"""Live role switching: an instance changes its roles without a restart (`SwitchRoles`).

`switch_roles(host, roles, drain_timeout_s, reason)`, one switch at a time per instance:
1. draining — the host reports `draining` and announces it to every scheduler (Register): the
   registry routes it nothing new, and what it already holds finishes here. A call routed just
   before the announcement may still arrive: it is taken and drained like the rest.
2. drain — wait until no worker holds a request (handles, KV pairs still bootstrapping, engine
   work, KV transfers still going), seen idle twice `SETTLE_S` apart. Past `drain_timeout_s` what
   is left is aborted and the scheduler retries it elsewhere (the one case where a switch causes
   a retry; logged as such).
3. rebuild — stop the workers (their engines' KV caches and encoder space go with them) and start
   those of the new roles on the model the process already holds (no reload): a P or D gets a KV
   cache, an E only its small encoder-side cache; the KV pair store is served (KvStore) while a
   worker prefills for remote D instances.
4. announce — a new instance id (KV pair names and the scheduler's per-instance bookkeeping start
   fresh), Register it, then Deregister the old id, on which nothing is in flight any more, so
   no request is retried; draining ends.
A call for a stage the instance does not run while a switch is under way (its workers are being
rebuilt, or it was routed by the roster from before) is answered ABORTED, which the scheduler
retries elsewhere.

Overlapped (`--switch-overlap`, auto: on CPU instances, and on an accelerator with room for both
sets of workers' KV caches), the stages the instance keeps or gains serve through the switch
instead of waiting out the drain (a split of a lone coupled engine otherwise stalls every new
request for its longest running decode):
1. build — the new roles' workers start beside the old ones, on the same model (the old ones keep
   taking work meanwhile; if the new ones cannot start, nothing changed);
2. swap and announce — the new workers become the instance under a new id, which is registered
   after the old id is registered again as draining: new work goes to the new workers, what the
   old ones hold finishes on them, and a call routed by the roster from before still finds the
   old worker of its stage (`InstanceHost.worker`);
3. drain the old workers as above (the timeout aborts what is left), stop them, Deregister the old
   id. The cost: two sets of workers — two KV caches — for the drain's length, which is why auto
   on an accelerator overlaps only when the device has that room (`InstanceHost.overlaps_switches`).
"""
from __future__ import annotations

import gc
import logging
import secrets
import time
from dataclasses import dataclass

from epdserve.roles import normalize_roles
from epdserve.instance.identity import opaque_instance_id

log = logging.getLogger(__name__)

SETTLE_S = 0.2  # idle twice this far apart: no call routed before the announcement is still on its way
_POLL_S = 0.02


@dataclass(frozen=True)
class SwitchResult:
    previous_instance_id: str
    instance_id: str
    roles: str
    drain_s: float
    rebuild_s: float
    aborted: int  # requests still in flight at the drain timeout (retried by the scheduler)


class SwitchError(RuntimeError):
    """The switch could not be made (bad roles, one already under way, rebuild failed)."""


def _idle(worker) -> bool:
    """No request held by this worker (runs on its loop thread)."""
    return not worker.handles and not worker.has_engine_work() and not worker.has_pending_transfers()


def all_idle(workers, timeout_s: float = 30.0) -> bool:
    return all(w.call(lambda w=w: _idle(w)).result(timeout_s) for w in workers)


def drain(workers, timeout_s: float) -> tuple[float, int]:
    """Wait for the workers to finish what they hold; returns (seconds, requests aborted at the timeout)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    idle_since = None
    while True:
        now = time.monotonic()
        if all_idle(workers):
            idle_since = idle_since or now
            if now - idle_since >= SETTLE_S:
                return now - t0, 0
        else:
            idle_since = None
        if now > deadline:
            break
        time.sleep(_POLL_S)
    aborted = 0
    for w in workers:
        for rid in w.call(lambda w=w: list(w.handles)).result(30.0):
            w.abort(rid).result(30.0)
            aborted += 1
    log.warning("drain timed out after %.1f s: %d request(s) aborted, the scheduler retries them elsewhere",
                timeout_s, aborted)
    return time.monotonic() - t0, aborted


def new_instance_id(host, roles: str) -> str:
    """The identity after a switch: the operator's --instance-id with a fresh suffix, else a new
    opaque id (no address in it)."""
    if host.config.instance_id:
        return f"{host.config.instance_id}-{secrets.token_hex(3)}"
    return opaque_instance_id(roles)


def switch_roles(host, roles: str, drain_timeout_s: float, reason: str = "") -> SwitchResult:
    """Switch `host` (an InstanceHost) to `roles` in place; see the module docstring."""
    try:
        roles = normalize_roles(roles)
    except ValueError as e:
        raise SwitchError(str(e)) from None
    if not host.switch_lock.acquire(blocking=False):
        raise SwitchError(f"instance {host.instance_id} is already switching roles")
    try:
        if host.overlaps_switches(roles):
            return _switch_overlapped(host, roles, drain_timeout_s, reason)
        return _switch(host, roles, drain_timeout_s, reason)
    finally:
        host.switch_lock.release()


def _switch(host, roles: str, drain_timeout_s: float, reason: str) -> SwitchResult:
    old_id, old_roles = host.instance_id, host.roles
    log.info("switching %s from %s to %s%s", old_id, old_roles, roles, f" ({reason})" if reason else "")
    host.draining = True
    try:
        host.announce()
        drain_s, aborted = drain(list(host.workers), drain_timeout_s)
    except BaseException:  # nothing changed yet: take work again
        _take_work_again(host)
        raise
    t0 = time.monotonic()
    try:
        host.rebuild(roles, new_instance_id(host, roles))
    except Exception as e:
        log.exception("rebuilding %s as %s failed; restoring %s", old_id, roles, old_roles)
        host.rebuild(old_roles, old_id)  # if this fails too, the instance stays draining (never routed)
        _take_work_again(host)
        raise SwitchError(f"could not switch to {roles}: {e}; still {old_roles}") from e
    gc.collect()  # the old engines' KV caches
    rebuild_s = time.monotonic() - t0
    host.draining = False
    host.announce(previous_id=old_id)
    log.info("switched %s (%s) -> %s (%s): drained in %.2f s, rebuilt in %.2f s", old_id, old_roles,
             host.instance_id, roles, drain_s, rebuild_s)
    return SwitchResult(old_id, host.instance_id, roles, drain_s, rebuild_s, aborted)


def _switch_overlapped(host, roles: str, drain_timeout_s: float, reason: str) -> SwitchResult:
    old_id, old_roles = host.instance_id, host.roles
    new_id = new_instance_id(host, roles)
    log.info("switching %s from %s to %s, new workers beside the old%s", old_id, old_roles, roles,
             f" ({reason})" if reason else "")
    t0 = time.monotonic()
    try:
        old = host.build_beside(roles, new_id)
    except Exception as e:  # the old workers never stopped taking work: nothing changed
        log.exception("starting %s workers beside %s failed; still %s", roles, old_id, old_roles)
        raise SwitchError(f"could not switch to {roles}: {e}; still {old_roles}") from e
    rebuild_s = time.monotonic() - t0
    try:
        host.announce(before=old)  # the old id draining (its calls finish here), the new id taking work
    except Exception:  # the new workers serve either way; heartbeats register the new id once it answers
        log.exception("could not announce %s (draining) and %s to the scheduler", old_id, new_id)
    drain_s, aborted = drain(host.retiring, drain_timeout_s)
    host.retire()
    gc.collect()  # the old engines' KV caches
    host.announce(previous_id=old_id)
    log.info("switched %s (%s) -> %s (%s): new workers serving after %.2f s, old ones drained in %.2f s beside "
             "them", old_id, old_roles, new_id, roles, rebuild_s, drain_s)
    return SwitchResult(old_id, new_id, roles, drain_s, rebuild_s, aborted)


def _take_work_again(host) -> None:
    """Draining ends without a switch: tell the schedulers (best effort; heartbeats re-register)."""
    host.draining = False
    try:
        host.announce()
    except Exception:
        log.exception("could not tell the scheduler that %s takes work again", host.instance_id)
