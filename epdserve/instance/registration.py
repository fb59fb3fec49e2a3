"""Keeps an instance on the scheduler's roster: Register, Heartbeat with load, Deregister.

A thread registers (retrying with capped backoff until the scheduler answers), then sends a
Heartbeat every `heartbeat_interval_s` the scheduler asked for. A heartbeat answered
`known=False` (the scheduler restarted or forgot us) registers again. An unreachable
scheduler is logged once per outage, never fatal: the instance keeps serving calls it gets.
`stop()` deregisters (best effort, short deadline).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc

log = logging.getLogger(__name__)


class Registrar:
    def __init__(self, scheduler: str, status: Callable[[], common_pb2.InstanceStatus], *,
                 rpc_timeout_s: float = 3.0, max_backoff_s: float = 2.0):
        self.scheduler = scheduler
        self.status = status
        self.rpc_timeout_s = rpc_timeout_s
        self.max_backoff_s = max_backoff_s
        self.interval_s = 1.0
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(scheduler)
        self._stub = instance_pb2_grpc.RegistryStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self._down_logged = False

    def start(self) -> "Registrar":
        self._thread.start()
        return self

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                else:
                    self._heartbeat()
                backoff = 0.05
                if self._down_logged:
                    log.info("scheduler %s reachable again", self.scheduler)
                    self._down_logged = False
                self._stop.wait(self.interval_s if self.registered.is_set() else backoff)
            except grpc.RpcError as e:
                if not self._down_logged:
                    log.warning("scheduler %s unreachable (%s); retrying", self.scheduler, e.code())
                    self._down_logged = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def _register(self) -> None:
        resp = self._stub.Register(instance_pb2.RegisterRequest(instance=self.status()), timeout=self.rpc_timeout_s)
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        st = self.status()
        log.info("registered %s (%s) at %s with scheduler %s", st.instance_id, st.roles, st.address, self.scheduler)
        self.registered.set()

    def _heartbeat(self) -> None:
        st = self.status()
        resp = self._stub.Heartbeat(instance_pb2.HeartbeatRequest(instance_id=st.instance_id, load=st.load),
                                    timeout=self.rpc_timeout_s)
        if not resp.known:
            log.info("scheduler %s does not know %s any more; registering again", self.scheduler, st.instance_id)
            self.registered.clear()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.rpc_timeout_s + 1.0)
        if deregister and self.registered.is_set():
            try:
                self._stub.Deregister(instance_pb2.DeregisterRequest(instance_id=self.status().instance_id), timeout=1.0)
            except grpc.RpcError as e:
                log.debug("deregister failed: %s", e.code())
        self._channel.close()
