"""The instance roster: who is up, what roles they run, how busy they are, and their health.

Health hysteresis (one state machine per instance, driven by the prober, heartbeats and failed
RPCs): HEALTHY --failure--> SUSPECT (still routed to) --`unhealthy_after` consecutive
failures--> DOWN (not routed to; listeners told, so requests on it are retried elsewhere)
--`healthy_after` consecutive successes--> HEALTHY. Any success resets the failure count;
registering (a fresh process) makes an instance HEALTHY at once. DOWN instances are forgotten
after `forget_after_s`; one that comes back later simply registers again.

The registry also holds the scheduler's own bookkeeping per instance: work it has dispatched
and not seen finish (`outstanding[role]`) and requests in flight on it (`inflight`), which the
router uses for least-outstanding-work choice and backpressure. It lives on the scheduler's
event loop: every call comes from that one thread, so it takes no locks.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from epdserve.kv_layout import KvLayout, pair_mismatch
from epdserve.rpc import common_pb2
from epdserve.roles import POOLS, RoleSet, normalize_roles, role_set
from epdserve.scheduler.prompt_chunks import DEFAULT_BLOCK_SIZE

log = logging.getLogger(__name__)

HEALTHY, SUSPECT, DOWN = common_pb2.HEALTHY, common_pb2.SUSPECT, common_pb2.DOWN


class RegistryError(ValueError):
    """A registration the scheduler refuses (bad roles, another model's media namespace, a KV layout
    that cannot map to a registered instance's on the other side of the P→D hop)."""


@dataclass
class InstanceRecord:
    instance_id: str
    roles: str
    address: str
    model: str = ""
    namespace: str = ""
    kv_endpoint: common_pb2.KvEndpoint = field(default_factory=common_pb2.KvEndpoint)
    pid: int = 0
    load: common_pb2.Load = field(default_factory=common_pb2.Load)
    health: int = HEALTHY
    failures: int = 0
    successes: int = 0
    last_seen: float = 0.0
    down_since: float | None = None
    heartbeats: bool = True  # registered itself (static instances are adopted and only probed)
    last_heartbeat: float = 0.0
    outstanding: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POOLS, 0))  # per pool (roles.POOLS)
    inflight: int = 0
    draining: bool = False  # switching roles: finishes what it holds, takes nothing new
    compute: str = ""  # InstanceStatus.compute: equal values share their compute
    block_size: int = DEFAULT_BLOCK_SIZE  # InstanceStatus.block_size: its engines' KV block (prefix hashes)
    kv_layout: KvLayout | None = None  # InstanceStatus.kv_layout: its KV's registration record (None: holds no KV)

    @property
    def role_set(self) -> RoleSet:
        """What its roles mean (epdserve/roles.py)."""
        return role_set(self.roles)

    def has(self, pool: str) -> bool:
        """Does it take calls of `pool` (E, P, D; PD: whole requests)? A "P+E" instance serves P
        only (`RoleSet.takes`)."""
        return self.role_set.takes(pool)

    @property
    def degree(self) -> int:
        """Its language model's tensor-parallel degree (its KV record's; 1 for an instance that
        holds no KV): the router divides its outstanding work by it."""
        return self.kv_layout.degree if self.kv_layout is not None else 1

    @property
    def encodes_inline(self) -> bool:
        """It encodes the media of what it prefills itself (EPD, P+E): no E needed."""
        return self.role_set.encodes_inline

    @property
    def coupled(self) -> bool:
        """One engine runs P and D back to back (PD, EPD): it takes whole requests."""
        return self.role_set.coupled

    @property
    def routable(self) -> bool:
        """May new work go here? (Not DOWN, not draining for a role switch.)"""
        return self.health != DOWN and not self.draining

    def to_proto(self) -> common_pb2.InstanceStatus:
        return common_pb2.InstanceStatus(
            instance_id=self.instance_id, roles=self.roles, address=self.address, model=self.model,
            media_namespace=self.namespace, load=self.load, kv_endpoint=self.kv_endpoint, health=self.health,
            last_seen=self.last_seen, pid=self.pid, draining=self.draining, compute=self.compute,
            block_size=self.block_size,
            kv_layout=common_pb2.KvLayout(**self.kv_layout.to_dict()) if self.kv_layout else None,
        )


class InstanceRegistry:
    def __init__(self, unhealthy_after: int = 3, healthy_after: int = 2, forget_after_s: float = 300.0,
                 clock: Callable[[], float] = time.time):
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._records: dict[str, InstanceRecord] = {}
        self._down_listeners: list[Callable[[InstanceRecord], None]] = []

    # ---------------------------------------------------------------- roster
    def register(self, status: common_pb2.InstanceStatus, heartbeats: bool = True) -> InstanceRecord:
        if not status.instance_id:
            raise RegistryError("instance_id is required")
        if not status.address:
            raise RegistryError(f"{status.instance_id}: address is required")
        try:
            roles = normalize_roles(status.roles)
        except ValueError as e:
            raise RegistryError(f"{status.instance_id}: {e}") from None
        ns = status.media_namespace
        if ns:
            for other in self._records.values():
                if other.namespace and other.namespace != ns and other.instance_id != status.instance_id:
                    raise RegistryError(
                        f"{status.instance_id} serves media namespace {ns!r} but {other.instance_id} serves "
                        f"{other.namespace!r}: one scheduler serves one model"
                    )
        layout = KvLayout.from_message(status.kv_layout) if status.HasField("kv_layout") else None
        self._check_pairs(status.instance_id, role_set(roles), layout)
        now = self.clock()
        rec = self._records.get(status.instance_id)
        if rec is None:
            rec = InstanceRecord(status.instance_id, roles, status.address)
            self._records[rec.instance_id] = rec
            log.info("instance %s joined: roles %s at %s", rec.instance_id, roles, status.address)
        elif rec.health == DOWN:
            log.info("instance %s re-registered (was down)", rec.instance_id)
        rec.roles, rec.address, rec.model, rec.namespace = roles, status.address, status.model, ns
        rec.kv_endpoint = common_pb2.KvEndpoint()
        rec.kv_endpoint.CopyFrom(status.kv_endpoint)
        rec.pid = status.pid
        rec.compute = status.compute
        rec.block_size = status.block_size or DEFAULT_BLOCK_SIZE
        rec.kv_layout = layout
        if status.draining != rec.draining:
            log.info("instance %s %s", rec.instance_id, "is draining (switching roles)" if status.draining
                     else "takes work again")
        rec.draining = status.draining
        if status.HasField("load"):
            rec.load = status.load
        rec.heartbeats = heartbeats
        rec.health, rec.failures, rec.successes, rec.down_since = HEALTHY, 0, 0, None
        rec.last_seen = rec.last_heartbeat = now
        return rec

    def _check_pairs(self, instance_id: str, roles: RoleSet, layout: KvLayout | None) -> None:
        """RegistryError, naming both records, when `layout` cannot map to the KV layout of a routable
        instance on the other side of the P→D hop (a P against each D, a D against each P), or when
        two instances that compute with the LM run it in different dtypes or quantizations (one
        scheduler serves one model: a request would get another answer on a retry)."""
        if layout is None:
            return
        hop = lambda r: (roles.sends_kv and r.role_set.receives_kv) or (roles.receives_kv and r.role_set.sends_kv)  # noqa: E731
        for other in sorted(self.records(), key=lambda r: not hop(r)):  # the P→D counterparts' full check first
            if other.instance_id == instance_id or other.kv_layout is None or other.health == DOWN:
                continue
            if roles.sends_kv and other.role_set.receives_kv:
                p, d, names = layout, other.kv_layout, (instance_id, other.instance_id)
            elif roles.receives_kv and other.role_set.sends_kv:
                p, d, names = other.kv_layout, layout, (other.instance_id, instance_id)
            else:
                o = other.kv_layout
                if (layout.dtype, layout.quantization) != (o.dtype, o.quantization):
                    raise RegistryError(
                        f"{instance_id} runs the model in {layout.dtype}, weights {layout.quantization or 'unquantized'}, "
                        f"but {other.instance_id} in {o.dtype}, weights {o.quantization or 'unquantized'}: one "
                        f"scheduler serves one model, in one dtype and quantization (give every instance the same "
                        f"--dtype and --quantization)")
                continue
            why = pair_mismatch(p, d)
            if why:
                raise RegistryError(f"{instance_id} cannot pair with {other.instance_id}: the KV prefill instance "
                                    f"{names[0]} computes cannot become decode instance {names[1]}'s: {why}")

    def heartbeat(self, instance_id: str, load: common_pb2.Load | None = None) -> bool:
        rec = self._records.get(instance_id)
        if rec is None:
            return False
        rec.last_heartbeat = self.clock()
        if load is not None:
            rec.load = load
        self.record_success(instance_id)
        return True

    def deregister(self, instance_id: str) -> bool:
        rec = self._records.pop(instance_id, None)
        if rec is not None:
            log.info("instance %s left", instance_id)
            self._notify_down(rec)
        return rec is not None

    def get(self, instance_id: str) -> InstanceRecord | None:
        return self._records.get(instance_id)

    def records(self) -> list[InstanceRecord]:
        return sorted(self._records.values(), key=lambda r: r.instance_id)

    def candidates(self, pool: str) -> list[InstanceRecord]:
        """Routable instances that take calls of `pool` ("E", "P", "D"; "PD" = coupled), by id."""
        return [r for r in self.records() if r.routable and r.has(pool)]

    def switching(self) -> bool:
        """Is an instance draining for a role switch? (A role with no instance now may have one soon.)"""
        return any(r.draining for r in self._records.values())

    @property
    def namespace(self) -> str:
        """The media-key namespace the instances report ("" until one reports it)."""
        return next((r.namespace for r in self.records() if r.namespace), "")

    @property
    def model(self) -> str:
        return next((r.model for r in self.records() if r.model), "")

    # ---------------------------------------------------------------- health
    def record_success(self, instance_id: str) -> None:
        rec = self._records.get(instance_id)
        if rec is None:
            return
        rec.last_seen = self.clock()
        rec.failures = 0
        if rec.health == DOWN:
            rec.successes += 1
            if rec.successes >= self.healthy_after:
                rec.health, rec.successes, rec.down_since = HEALTHY, 0, None
                log.info("instance %s is healthy again", instance_id)
        else:
            rec.health = HEALTHY

    def record_failure(self, instance_id: str, reason: str = "") -> None:
        rec = self._records.get(instance_id)
        if rec is None:
            return
        rec.successes = 0
        rec.failures += 1
        if rec.health == DOWN:
            return
        if rec.failures >= self.unhealthy_after:
            rec.health, rec.down_since = DOWN, self.clock()
            log.warning("instance %s is down after %d failures (%s)", instance_id, rec.failures, reason or "no reason")
            self._notify_down(rec)
        else:
            rec.health = SUSPECT

    def forget_stale(self) -> list[str]:
        now = self.clock()
        gone = [r.instance_id for r in self._records.values()
                if r.health == DOWN and r.down_since is not None and now - r.down_since > self.forget_after_s]
        for iid in gone:
            del self._records[iid]
            log.info("instance %s forgotten (down for over %.0f s)", iid, self.forget_after_s)
        return gone

    def on_down(self, listener: Callable[[InstanceRecord], None]) -> None:
        """Call `listener(record)` whenever an instance goes DOWN or deregisters."""
        self._down_listeners.append(listener)

    def _notify_down(self, rec: InstanceRecord) -> None:
        for fn in list(self._down_listeners):
            try:
                fn(rec)
            except Exception:  # a listener's bug must not break health tracking
                log.exception("down listener failed for %s", rec.instance_id)
