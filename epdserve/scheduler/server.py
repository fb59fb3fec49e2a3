"""`SchedulerServer`: the scheduler process's gRPC server, and `SchedulerThread` to host one.

Two grpc.aio servers on one event loop: the public port serves `EPDServe` (clients),
grpc.health.v1 and reflection; the internal port (`SchedulerSecurity.internal_host:
internal_port`, loopback by default) serves the `Registry` (instances), health and reflection —
an internal RPC is never served on the public port. Before binding, `check_exposure` refuses a
port beyond loopback that would serve unauthenticated callers. Keys, tokens and TLS:
`epdserve.security`. Starting it loads the tokenizer and image processor (not the
model), binds (port 0 picks a free one; `address` says which), and starts the health prober.
`SchedulerThread` runs a server on its own loop in a background thread (tests, embedding);
the `epdserve scheduler` command runs one in the foreground.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import grpc

from epdserve.rpc import REGISTRY_SERVICE, SERVE_SERVICE, instance_pb2_grpc, serve_pb2_grpc
from epdserve.rpc.servers import add_health_and_reflection, set_serving_aio
from epdserve.scheduler.channels import CHANNEL_OPTIONS, ChannelPool
from epdserve.scheduler.config import SchedulerConfig
from epdserve.scheduler.dispatcher import Dispatcher
from epdserve.scheduler.health import HealthProber
from epdserve.scheduler.preprocess import RequestPreprocessor
from epdserve.scheduler.registry import InstanceRegistry
from epdserve.scheduler.routing import Router
from epdserve.scheduler.services import EPDServeServicer, RegistryServicer
from epdserve.seams.media_keys import MEDIA_KEY_SECRET_ENV, MediaKeySecret
from epdserve.security.interceptors import AioAuthInterceptor, aio_metadata_interceptors, cluster_metadata
from epdserve.security.options import SchedulerSecurity
from epdserve.security.tenants import DEFAULT_TENANT
from epdserve.security.tls import channel_credentials, server_credentials

log = logging.getLogger(__name__)

VERSION = "0.1.0"


class SchedulerServer:
    """`observer`: optional; `observer.observe(stream, server)` wraps every public request's delta
    stream (the entrypoints pass the Prometheus metrics here; nothing in scheduler/ knows them);
    its `interceptor()`, when it has one, goes outermost on the public port, to see the calls
    refused before the servicer (the API key's UNAUTHENTICATED).
    `security`: API key, cluster token, TLS and the internal port (`SchedulerSecurity`; default:
    none of them, everything on one plaintext port)."""

    def __init__(self, config: SchedulerConfig, observer=None, security: SchedulerSecurity | None = None,
                 controller_observer=None):
        self.config = config
        self.observer = observer
        self.controller_observer = controller_observer  # `--controller`: its decisions as metrics (metrics/controller.py)
        self.controller = None  # `--controller`: the role controller's loop (scheduler/controller.py)
        self._controller_task: asyncio.Task | None = None
        self.security = security or SchedulerSecurity()
        self.scheduler_id = f"scheduler-{uuid.uuid4().hex[:8]}"
        self.registry = InstanceRegistry(config.unhealthy_after, config.healthy_after, config.forget_after_s)
        sec = self.security
        self.channels = ChannelPool(aio_metadata_interceptors(cluster_metadata(sec.cluster_token)),
                                    channel_credentials(sec.internal_tls_ca, sec.internal_tls_cert,
                                                        sec.internal_tls_key) if sec.mutual_tls else None)
        self.router = Router(self.registry, config.max_inflight_per_instance, config.routing, config.prefix_index_size)
        self.prober = HealthProber(config, self.registry, self.channels)
        self.dispatcher: Dispatcher | None = None
        self.address = ""
        self.internal_address = ""  # where instances register: the internal port
        self._server: grpc.aio.Server | None = None
        self._internal: grpc.aio.Server | None = None
        self._health = None
        self._probe_task: asyncio.Task | None = None

    async def start(self) -> str:
        self.security.check_exposure(self.config.host)  # before any work: a refusal is immediate
        loop = asyncio.get_running_loop()
        secret = self.security.media_key_secret or MediaKeySecret.load()
        if secret is None:
            secret = MediaKeySecret.of_process()
            log.warning("no media-key secret (%s or --media-key-secret-file): media keys are keyed with this "
                        "process's own, so features a shared MM Store holds are not found again after a restart",
                        MEDIA_KEY_SECRET_ENV)
        pre = await loop.run_in_executor(None, RequestPreprocessor, self.config.model, self.config.max_model_len,
                                         secret)
        self.dispatcher = Dispatcher(self.config, self.registry, self.router, self.channels, pre,
                                     tenant_weight=self.security.tenant_weight)
        sec = self.security
        # A request over the input limit is refused by gRPC as it arrives (RESOURCE_EXHAUSTED),
        # not buffered whole first; the public port only: registrations are small.
        outer = self.observer.interceptor() if hasattr(self.observer, "interceptor") else None
        server = _aio_server(sec.public_rules(), max_receive=self.config.limits.max_message_bytes, outer=outer)
        self.address = _bind(server, self.config.host, self.config.port, sec)
        info = {"scheduler_id": self.scheduler_id, "address": self.address, "started_at": time.time(),
                "version": VERSION}
        serve_pb2_grpc.add_EPDServeServicer_to_server(
            EPDServeServicer(self.config, self.dispatcher, self.registry, info, self.generate, sec.holds_token,
                             sec.tenant_of, multi_tenant=sec.api_keys_file is not None), server)
        # the Registry alone on its own port (loopback, or the cluster network with the token / mTLS)
        self._internal = _aio_server(sec.internal_rules())
        self.internal_address = _bind(self._internal, sec.internal_host, sec.internal_port, sec, internal=True)
        instance_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(self.config, self.registry, self.scheduler_id), self._internal)
        add_health_and_reflection(self._internal, [REGISTRY_SERVICE], aio=True)
        await self._internal.start()
        services = [SERVE_SERVICE]
        self._health = add_health_and_reflection(server, services, aio=True)
        await server.start()
        await set_serving_aio(self._health, services)
        self._server = server
        self._probe_task = asyncio.create_task(self.prober.run())
        if self.config.controller is not None:
            from epdserve.scheduler.controller import ControllerLoop, RoleController

            self.controller = ControllerLoop(RoleController(self.config.controller, self.controller_observer),
                                             self.registry.records, self._switch_roles)
            self.dispatcher.finished_listeners.append(self.controller.observe_request)
            self._controller_task = asyncio.create_task(self.controller.run())
            log.info("role controller on: a decision every %.0f s", self.config.controller.tick_s)
        log.info("scheduler %s listening on %s", self.scheduler_id, self.address)
        return self.address

    def generate(self, req, deadline: float | None = None, tenant: str = DEFAULT_TENANT):
        """The public request path every front takes (gRPC EPDServe, the HTTP front): the
        dispatcher's delta stream, through the observer; `tenant`: the caller's (its API key's,
        `epdserve.security.tenants`). Raises RequestError."""
        stream = self.dispatcher.generate(req, deadline, tenant)
        return stream if self.observer is None else self.observer.observe(stream, self, tenant)

    async def _switch_roles(self, move, reason: str, drain_timeout_s: float):
        """The controller's switch: Instance.SwitchRoles on the instance, until it serves its new roles."""
        from epdserve.rpc import instance_pb2

        rec = self.registry.get(move.instance_id)
        if rec is None:
            raise RuntimeError(f"instance {move.instance_id} left the roster")
        log.info("role controller: switching %s (%s)", move, reason)
        return await self.channels.get(rec.address).instance.SwitchRoles(
            instance_pb2.SwitchRolesRequest(roles=move.to_roles, drain_timeout_s=drain_timeout_s, reason=reason),
            timeout=drain_timeout_s + 600.0)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is None:
            return
        await set_serving_aio(self._health, [SERVE_SERVICE], serving=False)
        if self._probe_task is not None:
            self._probe_task.cancel()
        if self._controller_task is not None:
            self._controller_task.cancel()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        await self._server.stop(grace_s)
        if self._internal is not None:
            await self._internal.stop(grace_s)
            self._internal = None
        await self.channels.close()
        self._server = None

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def _aio_server(rules, max_receive: int | None = None, outer=None) -> grpc.aio.Server:
    """`outer`: an interceptor run before the auth check (it sees the calls that check refuses)."""
    options = [o for o in CHANNEL_OPTIONS if max_receive is None or o[0] != "grpc.max_receive_message_length"]
    if max_receive is not None:
        options.append(("grpc.max_receive_message_length", max_receive))
    interceptors = ([outer] if outer is not None else []) + ([AioAuthInterceptor(rules)] if rules else [])
    return grpc.aio.server(options=options, interceptors=interceptors or None)


def _bind(server: grpc.aio.Server, host: str, port: int, tls: SchedulerSecurity | None = None,
          internal: bool = False) -> str:
    """Bind host:port (public: TLS with `tls.tls_cert`; internal: mutual TLS with
    `tls.internal_tls_*`); the address clients dial."""
    where = f"{host}:{port}"
    if internal and tls is not None and tls.mutual_tls:
        bound = server.add_secure_port(where, server_credentials(tls.internal_tls_cert, tls.internal_tls_key,
                                                                 client_ca=tls.internal_tls_ca))
    elif not internal and tls is not None and tls.tls_cert:
        bound = server.add_secure_port(where, server_credentials(tls.tls_cert, tls.tls_key))
    else:
        bound = server.add_insecure_port(where)
    if bound == 0:
        raise OSError(f"cannot bind {where}")
    return f"{host if host not in ('0.0.0.0', '::', '[::]') else '127.0.0.1'}:{bound}"


class SchedulerThread:
    """A `SchedulerServer` on its own event loop in a daemon thread: `start()` -> address, `stop()`."""

    def __init__(self, config: SchedulerConfig, observer=None, security: SchedulerSecurity | None = None):
        self.config = config
        self.server = SchedulerServer(config, observer, security)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="epdserve-scheduler", daemon=True)

    @property
    def address(self) -> str:
        return self.server.address

    def start(self, timeout_s: float = 120.0) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout_s)

    def call(self, fn, timeout_s: float = 10.0):
        """Run `fn()` on the scheduler's loop (registry and dispatcher live there)."""
        async def _run():
            return fn()

        return asyncio.run_coroutine_threadsafe(_run(), self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            self.loop.close()

    def __enter__(self) -> SchedulerThread:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
