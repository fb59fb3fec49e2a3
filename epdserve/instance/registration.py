"""Keeps an instance on the scheduler's roster: Register, Heartbeat with load, Deregister.

A thread registers, then sends a Heartbeat every `heartbeat_interval_s` the scheduler asked
for. A heartbeat answered `known=False` (the scheduler restarted or forgot us) registers again.
A failed call is retried (tenacity) with exponential backoff capped at `max_backoff_s` until it
succeeds or `stop()` is called, which also cuts the backoff wait short. An unreachable
scheduler is logged once per outage, never fatal: the instance keeps serving calls it gets. A
refusal (FAILED_PRECONDITION: another model's instances, a KV layout that cannot pair) is logged
as an error with the scheduler's reason, once per reason, and retried the same way: the roster may
change (the conflicting instance leaves).
`stop()` deregisters (best effort, short deadline).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc
from tenacity import (RetryCallState, RetryError, Retrying, retry_if_exception_type, stop_after_attempt,
                      wait_exponential)

from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.05  # the first wait after a failure (and before registering again)
# gRPC's own reconnect backoff grows to 120 s by default: a restarted scheduler would wait that long
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class Registrar:
    def __init__(self, scheduler: str, status: Callable[[], common_pb2.InstanceStatus], *,
                 rpc_timeout_s: float = 3.0, max_backoff_s: float = 2.0, interceptors=(), credentials=None):
        """`interceptors`: client interceptors of the channel (the cluster token's metadata);
        `credentials`: grpc channel credentials for a TLS scheduler port (mutual TLS)."""
        self.scheduler = scheduler
        self.status = status
        self.rpc_timeout_s = rpc_timeout_s
        self.max_backoff_s = max_backoff_s
        self.interval_s = 1.0
        self.registered = threading.Event()
        self._stop = threading.Event()
        channel = grpc.secure_channel(scheduler, credentials, options=_CHANNEL_OPTIONS) if credentials \
            else grpc.insecure_channel(scheduler, options=_CHANNEL_OPTIONS)
        self._channel = grpc.intercept_channel(channel, *interceptors)
        self._stub = instance_pb2_grpc.RegistryStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self._down_logged = False
        self._refused = ""  # the scheduler's last refusal, logged once
        self._closed = False

    def start(self) -> "Registrar":
        self._thread.start()
        return self

    def _run(self) -> None:
        retrying = Retrying(
            retry=retry_if_exception_type(grpc.RpcError),
            wait=wait_exponential(multiplier=FIRST_BACKOFF_S, max=self.max_backoff_s),
            stop=lambda _: self._stop.is_set(),
            sleep=self._stop.wait,  # stop() ends the wait at once
            before_sleep=self._log_down,
        )
        while not self._stop.is_set():
            try:
                retrying(self._call)
            except RetryError:  # tenacity gave up: stop() came while the scheduler was unreachable
                return
            if self._stop.is_set():  # stop() came during a backoff wait (`_call` made no call)
                return
            if self._down_logged:
                log.info("scheduler %s reachable again", self.scheduler)
                self._down_logged = False
            self._stop.wait(self.interval_s if self.registered.is_set() else FIRST_BACKOFF_S)

    def _call(self) -> None:
        """One Register or Heartbeat; raises grpc.RpcError when the scheduler did not answer."""
        if self._stop.is_set():  # stop() came during a backoff wait: no further call
            return
        if not self.registered.is_set():
            self._register()
        else:
            self._heartbeat()

    def _log_down(self, attempt: RetryCallState) -> None:
        e = attempt.outcome.exception()
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # refused (roster conflict): say why, each new why once
            if e.details() != self._refused:
                self._refused = e.details()
                log.error("scheduler %s refused to register this instance (it gets no work until the conflict "
                          "is gone; retrying): %s", self.scheduler, e.details())
            return
        if not self._down_logged:
            log.warning("scheduler %s unreachable (%s); retrying", self.scheduler, e.code())
            self._down_logged = True

    def _register(self) -> None:
        st = self.status()
        resp = self._register_status(st)
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        log.info("registered %s (%s) at %s with scheduler %s", st.instance_id, st.roles, st.address, self.scheduler)
        self._refused = ""
        self.registered.set()

    def _register_status(self, status: common_pb2.InstanceStatus):
        return self._stub.Register(instance_pb2.RegisterRequest(instance=status), timeout=self.rpc_timeout_s)

    def _heartbeat(self) -> None:
        st = self.status()
        resp = self._stub.Heartbeat(instance_pb2.HeartbeatRequest(instance_id=st.instance_id, load=st.load),
                                    timeout=self.rpc_timeout_s)
        if not resp.known:
            log.info("scheduler %s does not know %s any more; registering again", self.scheduler, st.instance_id)
            self.registered.clear()

    def announce(self, previous_id: str | None = None, attempts: int = 5,
                 before: common_pb2.InstanceStatus | None = None) -> None:
        """Register `before` (an overlapped role switch: the old identity, draining, which this
        process keeps serving under until its work is done; it gets no heartbeats, the scheduler's
        health probes of our address keep it), then our status now (role switching: draining, or a
        new id and roles), then Deregister `previous_id`; a few quick retries, raising
        grpc.RpcError if they all fail."""
        def once() -> None:
            if before is not None:
                self._register_status(before)
            self._register()
            if previous_id and previous_id != self.status().instance_id:
                self._stub.Deregister(instance_pb2.DeregisterRequest(instance_id=previous_id),
                                      timeout=self.rpc_timeout_s)

        Retrying(retry=retry_if_exception_type(grpc.RpcError), stop=stop_after_attempt(attempts),
                 wait=wait_exponential(multiplier=FIRST_BACKOFF_S, max=self.max_backoff_s), sleep=self._stop.wait,
                 reraise=True)(once)

    def stop(self, deregister: bool = True) -> None:
        """Stop registering, deregister (best effort) and close the channel; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.rpc_timeout_s + 1.0)
        if deregister and self.registered.is_set():
            try:
                self._stub.Deregister(instance_pb2.DeregisterRequest(instance_id=self.status().instance_id), timeout=1.0)
            except grpc.RpcError as e:
                log.debug("deregister failed: %s", e.code())
        self._channel.close()
