"""The prober: every `probe_interval_s`, a grpc.health.v1 Check on every known instance.

SERVING counts as a success, anything else (NOT_SERVING, timeout, connection refused) as a
failure, in the registry's hysteresis (registry.py). Static instances (which send no
heartbeats) also get their load refreshed with `GetLoad`. Each round also forgets instances DOWN
for longer than `forget_after_s` (closing their channels) and adopts configured static
instances (addresses given to the scheduler instead of instances registering themselves) by
asking them `GetLoad`.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2

from epdserve.rpc import instance_pb2
from epdserve.scheduler.channels import ChannelPool
from epdserve.scheduler.config import SchedulerConfig
from epdserve.scheduler.registry import InstanceRecord, InstanceRegistry, RegistryError

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING


class HealthProber:
    def __init__(self, config: SchedulerConfig, registry: InstanceRegistry, channels: ChannelPool):
        self.config = config
        self.registry = registry
        self.channels = channels
        self._warned: set[str] = set()

    async def run(self) -> None:
        while True:
            try:
                await self.probe_round()
            except Exception:  # never let one bad round stop health tracking
                log.exception("health probe round failed")
            await asyncio.sleep(self.config.probe_interval_s)

    async def probe_round(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in self.registry.records()), self._adopt_static())
        for iid in self.registry.forget_stale():
            log.debug("forgot %s", iid)
        live = {r.address for r in self.registry.records()} | set(self.config.static_instances)
        for address in self.channels.addresses():
            if address not in live:
                await self.channels.drop(address)

    async def _probe(self, rec: InstanceRecord) -> None:
        stub = self.channels.get(rec.address).health
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.config.probe_timeout_s)
            ok = resp.status == SERVING
            reason = "" if ok else f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
        except grpc.aio.AioRpcError as e:
            ok, reason = False, f"probe {e.code().name}"
        if ok and not rec.heartbeats:  # adopted static instance: no heartbeats bring its load
            try:
                status = await self.channels.get(rec.address).instance.GetLoad(
                    instance_pb2.GetLoadRequest(), timeout=self.config.probe_timeout_s)
                rec.load = status.load
            except grpc.aio.AioRpcError:
                pass  # health said SERVING; the load stays as last known
        if ok:
            self.registry.record_success(rec.instance_id)
        else:
            self.registry.record_failure(rec.instance_id, reason)

    async def _adopt_static(self) -> None:
        known = {r.address for r in self.registry.records()}
        for address in self.config.static_instances:
            if address in known:
                continue
            try:
                status = await self.channels.get(address).instance.GetLoad(
                    instance_pb2.GetLoadRequest(), timeout=self.config.probe_timeout_s)
            except grpc.aio.AioRpcError as e:
                if address not in self._warned:
                    self._warned.add(address)
                    log.warning("static instance %s not reachable yet (%s)", address, e.code().name)
                continue
            status.address = address  # the address we reach it at, whatever it reports
            try:
                self.registry.register(status, heartbeats=False)
                self._warned.discard(address)
            except RegistryError as e:
                log.error("static instance %s refused: %s", address, e)
