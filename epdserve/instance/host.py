"""`InstanceHost`: one instance process — its stage workers, MM Store, KV rendezvous, gRPC server
and scheduler registration, started and stopped in order.

start: load the checkpoint once (`LoadedModel`, shared by every worker: co-located E+P or E+D
keep one copy of the vision tower and LM) → build the stage workers for `roles` (each builds its
engine — KV cache, scheduler, connector — on its own pinned thread, one after the other;
co-located workers on CPU get disjoint core sets) → the KV pair store (`PairStoreHost`, in
process) served through `Instance.KvStore` while a worker prefills for remote D instances → the
gRPC server (Instance + health + reflection) on a free port, the cluster token required on
Instance calls when one is set → SERVING → register with the scheduler (presenting the token)
and heartbeat.
restart: a worker holding KV blocks in an unbounded quarantine (a stuck HCCL receive with
HCCL_EXEC_TIMEOUT meaning "never") turns the instance NOT_SERVING (`check_restart`); `epdserve
instance` then stops it with deploy/supervisor.py's `RESTART_EXIT_CODE`, and the launcher's supervisor starts it again.
stop: NOT_SERVING → deregister → stop the server (short grace) → stop workers (closing their
KV pairs and feature providers) → close the store.
Role switches (instance/role_switch.py) either `rebuild` the workers after a drain, or start the
new ones beside the old (`build_beside`), which retire once drained (`retire`).
"""
from __future__ import annotations

import dataclasses

import logging
import os
import socket
import threading
from concurrent import futures

import grpc

from epdserve.engine.config import EngineConfig
from epdserve.instance.affinity import compute_id
from epdserve.platform.cores import available_cores
from epdserve.instance.colocation import device_share, stream_priority, worker_core_sets, yields
from epdserve.instance.config import InstanceConfig
from epdserve.instance.coupled_worker import CoupledWorker
from epdserve.instance.decode_worker import DecodeWorker
from epdserve.instance.device_share import apply_device_share
from epdserve.instance.identity import opaque_instance_id
from epdserve.instance.encode_worker import EncodeWorker
from epdserve.instance.prefill_worker import PrefillWorker
from epdserve.instance.registration import Registrar
from epdserve.instance.worker import sum_loads
from epdserve.instance.servicer import InstanceServicer
from epdserve.ops.npu_schema import installed_kv_write
from epdserve.roles import PREFILL, role_set
from epdserve.rpc import INSTANCE_SERVICE, common_pb2, instance_pb2_grpc
from epdserve.rpc.servers import add_health_and_reflection, set_serving
from epdserve.security.interceptors import AuthInterceptor, cluster_metadata, metadata_interceptors
from epdserve.settings import shared_values
from epdserve.security.options import InstanceSecurity
from epdserve.security.tls import channel_credentials, server_credentials
from epdserve.transfer.kv import PairNetwork, PairStoreHost

log = logging.getLogger(__name__)

_E_KV_BYTES = 8 << 20  # an encode-only engine never holds request KV
OVERLAP_HEADROOM = 1.25  # an overlapped switch on an accelerator: spare device memory >= this x the new KV caches
_MAX_MSG = 256 << 20
RESTART_CHECK_S = 1.0  # how often `epdserve instance` asks `check_restart`


class InstanceHost:
    """`security`: the cluster token to require and present (default: EPDSERVE_CLUSTER_TOKEN, if set)."""

    def __init__(self, config: InstanceConfig, security: InstanceSecurity | None = None):
        from epdserve.platform import resolve_device

        self.config = dataclasses.replace(config, device=resolve_device(config.device))  # "auto" -> its platform
        self.security = security or InstanceSecurity.from_env()
        self.roles = config.roles
        self.instance_id = config.instance_id or ""
        self.port = 0
        self.workers: list = []
        self._by_role: dict[str, object] = {}
        self._retiring: list = []  # a role switch's old workers, finishing what they hold (build_beside)
        self._retiring_by_role: dict[str, object] = {}
        self._store = None
        self._pair_store = PairStoreHost()  # the KV pairs' store: in process, served by our own port
        self._serves_pairs = False  # is it served (a worker prefills for remote D instances)?
        self._server: grpc.Server | None = None
        self._health = None
        self._registrars: list[Registrar] = []  # one per scheduler (--scheduler a:1,b:2 registers with both)
        self.model = None  # LoadedModel, shared by the workers
        self._compute = ""  # InstanceStatus.compute, once the model's device is known
        self.switch_lock = threading.Lock()  # one role switch at a time (instance/role_switch.py)
        self.draining = False  # switching roles (or asking for a restart): the scheduler routes us nothing new
        self._restart_requested = False  # check_restart found a reason: NOT_SERVING until the process ends
        self._ready_timeout_s = 600.0  # start()'s: also how long a role switch's new workers may take

    # ---------------------------------------------------------------- lifecycle
    def start(self, ready_timeout_s: float = 600.0) -> "InstanceHost":
        cfg = self.config
        bind = cfg.bind_host or cfg.host
        self.security.check_exposure(bind)
        rules = self.security.rules()  # the cluster token on every Instance call, when one is set
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.grpc_threads, thread_name_prefix="grpc"),
            options=[("grpc.max_receive_message_length", _MAX_MSG), ("grpc.max_send_message_length", _MAX_MSG)],
            interceptors=[AuthInterceptor(rules)] if rules else None,
        )
        sec = self.security
        if sec.mutual_tls:  # TLS only, and only clients with a certificate from the deployment's CA
            self.port = self._server.add_secure_port(f"{bind}:{cfg.port}",
                                                     server_credentials(sec.tls_cert, sec.tls_key, client_ca=sec.tls_ca))
        else:
            self.port = self._server.add_insecure_port(f"{bind}:{cfg.port}")
        if not self.port:
            raise OSError(f"cannot bind {bind}:{cfg.port}")
        if not self.instance_id:  # opaque: addresses only in views that need the cluster token
            self.instance_id = opaque_instance_id(self.roles)
        try:
            if cfg.mm_store:
                from epdserve.transfer.mm_store.store import RedisMMStore

                self._store = RedisMMStore(cfg.mm_store)
            from epdserve.engine.loaded_model import load_model
            from epdserve.engine.tp.shard import TPShard

            self._limit_device()  # before the load's first operator (set_device_limit: once per process)
            self.model = load_model(cfg.model, cfg.device, cfg.dtype, cfg.max_model_len,
                                    shard=TPShard(0, cfg.tensor_parallel_size), quantization=cfg.quantization)
            self._compute = compute_id(self.model.device, cfg.cores, socket.gethostname())
            self._ready_timeout_s = ready_timeout_s
            self._start_workers(ready_timeout_s)
            self._sync_rendezvous()
            instance_pb2_grpc.add_InstanceServicer_to_server(InstanceServicer(self), self._server)
            self._health = add_health_and_reflection(self._server, [INSTANCE_SERVICE])
            self._server.start()
            set_serving(self._health, [INSTANCE_SERVICE], True)
        except BaseException:
            self.stop()
            raise
        for scheduler in cfg.schedulers:
            creds = channel_credentials(sec.tls_ca, sec.tls_cert, sec.tls_key) if sec.mutual_tls else None
            self._registrars.append(Registrar(scheduler, self.status, credentials=creds, interceptors=metadata_interceptors(
                cluster_metadata(sec.cluster_token))).start())
        log.info("instance %s (%s) serving on %s:%d", self.instance_id, self.roles, cfg.host, self.port)
        return self

    def _limit_device(self) -> None:
        """--device-core-share: this process's share of its NPU (instance/device_share.py). With
        --npu-core-limits and co-located stages whose streams will be limited, the whole device is
        set as the process's limit when no share is given: set_device_limit must come before
        set_stream_limit (op-plugin torch_npu-set_stream_limit.md, 7.2.0 / 7.3.0 / 26.0.0)."""
        cfg = self.config
        share = cfg.device_core_share
        if share is None and cfg.npu_core_limits and cfg.split_cores and len(list(role_set(self.roles).workers)) > 1:
            share = 1.0
        if share is None:
            return
        from epdserve.platform import get_platform

        platform = get_platform(cfg.device)
        index = int(cfg.device.partition(":")[2] or 0)
        platform.set_thread_device(index)
        kv_write = installed_kv_write() if platform.name == "npu" else None
        workers = list(role_set(self.roles).workers)
        apply_device_share(platform, index, share, workers, kv_write, opted_in=cfg.npu_core_limits)

    def wait_registered(self, timeout_s: float) -> bool:
        return all(r.registered.wait(timeout_s) for r in self._registrars)

    def stop(self, grace_s: float = 2.0) -> None:
        if self._health is not None:
            set_serving(self._health, [INSTANCE_SERVICE], False)
        for r in self._registrars:
            r.stop()
        self._registrars = []
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1.0)
            self._server = None
        self._stop_workers()
        if self._store is not None:
            self._store.close()
            self._store = None
        self._serves_pairs = False
        self._pair_store.clear()
        log.info("instance %s stopped", self.instance_id)

    # ---------------------------------------------------------------- workers
    def _stop_workers(self) -> None:
        """Stop every stage worker, retiring ones included (their engines, KV connectors and feature
        providers go with them)."""
        workers = self.workers + self._retiring
        for w in workers:
            w.stop()
        _close_features(workers)
        self.workers, self._by_role, self._retiring, self._retiring_by_role = [], {}, [], {}

    def _start_workers(self, ready_timeout_s: float) -> None:
        self.workers, self._by_role = self._build_workers(self.roles, self.instance_id, ready_timeout_s)

    def _build_workers(self, roles_: str, instance_id: str, ready_timeout_s: float) -> tuple[list, dict]:
        """The started stage workers of `roles_` (and them by served stage); none left running on failure."""
        cfg = self.config
        sets = role_set(roles_).worker_sets
        roles = [w.name for w in sets]
        core_sets: list[list[int] | None] = [cfg.cores] * len(roles)
        weights = [1.0 - cfg.encode_core_share if w.holds_kv else cfg.encode_core_share for w in sets]
        cpu = cfg.device.startswith("cpu")
        if cpu and len(roles) > 1 and cfg.split_cores:
            core_sets = worker_core_sets(cfg.colocation, roles, cfg.cores or available_cores(), weights)
        kv_config = cfg.kv_transfer(PairNetwork.for_instance(cfg.host, self.security, self._pair_store))
        workers, by_role = [], {}
        for rs, cores, weight in zip(sets, core_sets, weights):
            role = rs.name
            factory = self._engine_factory(role, instance_id)
            name = f"{role}-worker"
            if rs.coupled:
                w = CoupledWorker(name, factory, cores)
            elif rs.sends_kv:
                w = PrefillWorker(name, factory, cores, kv_config=kv_config)
            elif rs.receives_kv:
                w = DecodeWorker(name, factory, cores, instance_id=instance_id, kv_config=kv_config)
            else:
                w = EncodeWorker(name, factory, cores)
            w.low_priority = yields(cfg.colocation, role)
            if not cpu and len(roles) > 1 and cfg.split_cores:
                w.colocated = True
                w.device_share = device_share(cfg.colocation, role, weight)
                w.stream_priority = stream_priority(cfg.colocation, role)
                w.core_limits_opted_in = cfg.npu_core_limits
            workers.append(w)
            by_role[rs.worker_key] = w
        try:
            for w in workers:  # one at a time: transformers' lazy imports are not thread-safe
                w.start().wait_ready(ready_timeout_s)
        except BaseException:
            for w in workers:
                w.stop()
            _close_features(workers)
            raise
        return workers, by_role

    def rebuild(self, roles: str, instance_id: str) -> None:
        """Stop the workers and start those of `roles` on the loaded model, under `instance_id`
        (role switching; the caller drained them first)."""
        self._stop_workers()
        self.roles = self.config.roles = roles
        self.instance_id = instance_id
        self._start_workers(self._ready_timeout_s)
        self._sync_rendezvous()

    def overlaps_switches(self, roles: str) -> bool:
        """Does a switch to `roles` start the new workers beside the old ones (`--switch-overlap`)?
        Auto: on CPU, and on an accelerator when the device has room for the new workers' KV
        caches beside the old ones (`OVERLAP_HEADROOM` times them, for their activations)."""
        cfg = self.config
        if cfg.switch_overlap == "off":
            return False
        if cfg.switch_overlap == "on" or cfg.device.startswith("cpu"):
            return True
        need = sum(cfg.kv_cache_bytes if w.holds_kv else _E_KV_BYTES for w in role_set(roles).worker_sets)
        try:
            spare = self.model.platform.spare_memory_bytes(self.model.device.index or 0)
        except Exception as e:  # a runtime without the query: drain first, as before
            log.warning("cannot read the device's free memory (%s); switching to %s drained first", e, roles)
            return False
        fits = spare is not None and spare >= OVERLAP_HEADROOM * need
        log.info("switch to %s: %s MiB spare on the device for %s MiB of new KV caches: %s", roles,
                 "?" if spare is None else spare >> 20, need >> 20, "overlapped" if fits else "drained first")
        return fits

    def build_beside(self, roles: str, instance_id: str) -> common_pb2.InstanceStatus:
        """Start the workers of `roles` beside the running ones and make them this instance
        (`instance_id`, new work goes to them); the old workers retire: they keep what they hold
        (and calls for the stages only they serve) until `retire()`. Returns the old identity's
        status, marked draining. Nothing changes when the new workers cannot start (raises)."""
        workers, by_role = self._build_workers(roles, instance_id, self._ready_timeout_s)
        old = self.status()
        old.draining = True
        self._retiring, self._retiring_by_role = self.workers, self._by_role
        self.workers, self._by_role = workers, by_role
        self.roles = self.config.roles = roles
        self.instance_id = instance_id
        self._sync_rendezvous()
        return old

    @property
    def retiring(self) -> list:
        return list(self._retiring)

    def retire(self) -> None:
        """Stop the retiring workers (`build_beside`; the caller drained them)."""
        workers, self._retiring, self._retiring_by_role = self._retiring, [], {}
        for w in workers:
            w.stop()
        _close_features(workers)
        self._sync_rendezvous()

    def all_workers(self) -> list:
        """Serving and retiring workers (a client's Abort may be for a request either holds)."""
        return list(self.workers) + list(self._retiring)

    def _sync_rendezvous(self) -> None:
        """The KV pair store is served (`Instance.KvStore`, on our own port, with its credentials)
        and advertised while a worker (serving or retiring) prefills for remote D instances; not
        otherwise, and emptied then."""
        self._serves_pairs = PREFILL in self._by_role or PREFILL in self._retiring_by_role
        if not self._serves_pairs:
            self._pair_store.clear()

    @property
    def pair_store(self) -> PairStoreHost | None:
        """The KV pair store `Instance.KvStore` serves, None while nothing here prefills for remote D."""
        return self._pair_store if self._serves_pairs else None

    def announce(self, previous_id: str | None = None, before: common_pb2.InstanceStatus | None = None) -> None:
        """Tell every scheduler `before` (a retiring identity's status), then our status now
        (Register), then that `previous_id` is gone."""
        for r in self._registrars:
            r.announce(previous_id, before=before)

    def switch_roles(self, roles: str, drain_timeout_s: float = 60.0, reason: str = ""):
        """Change roles in place (instance/role_switch.py); returns its SwitchResult."""
        from epdserve.instance.role_switch import switch_roles

        return switch_roles(self, roles, drain_timeout_s, reason)

    def _engine_factory(self, role: str, instance_id: str):
        cfg = self.config

        def build(connector):  # on the worker's own thread
            from epdserve.engine.llm_engine import LLMEngine

            self.model.platform.set_thread_device(self.model.device.index or 0)  # per thread on NPU

            ecfg = EngineConfig(**shared_values(cfg, EngineConfig), roles=role)
            if not ecfg.role_set.holds_kv:
                ecfg.kv_cache_bytes = _E_KV_BYTES
            return LLMEngine(ecfg, model=self.model, features=self._provider(role, instance_id), kv_connector=connector)

        return build

    def _provider(self, role: str, instance_id: str):
        rs = role_set(role)
        if rs.receives_kv or self._store is None:
            return None  # the engine's in-process cache
        from epdserve.transfer.mm_store.provider import MMStoreFeatureProvider

        listens = rs.prefills and not rs.encodes_inline  # someone else's E sends it events
        return MMStoreFeatureProvider(self._store, role, instance_id=instance_id if listens else None,
                                      cache_bytes=self.config.feature_cache_bytes)

    def worker(self, role: str):
        """The worker new calls for `role` go to: a serving one, else a retiring one (a call routed
        by the roster from before a switch finishes where the old roles run)."""
        return self._by_role.get(role) or self._retiring_by_role.get(role)

    # ---------------------------------------------------------------- restart on request
    def restart_reason(self) -> str | None:
        """Why this process must be restarted, or None: a worker's KV connector holds blocks in a
        quarantine with no bound (`LayerwiseRecvConnector.restart_reason`)."""
        for w in self.workers + self._retiring:
            ask = getattr(w.connector, "restart_reason", None)
            why = ask() if ask is not None else None
            if why:
                return f"{w.name}: {why}"
        return None

    def check_restart(self) -> str | None:
        """`restart_reason`, and when there is one: health NOT_SERVING (the scheduler's probes
        take the instance out of routing), `draining` in its status (its next heartbeat stops
        new work at once), logged once. The caller (`epdserve instance`) then stops the process
        with `RESTART_EXIT_CODE`, which the launcher's supervisor restarts."""
        why = self.restart_reason()
        if why is None:
            return None
        if not self._restart_requested:
            self._restart_requested = True
            self.draining = True
            if self._health is not None:
                set_serving(self._health, [INSTANCE_SERVICE], False)
            log.error("instance %s asks for a restart: %s", self.instance_id, why)
        return why

    # ---------------------------------------------------------------- status
    def _block_size(self) -> int:
        """Tokens per KV block of the engines that hold request KV (the router hashes prompts in
        blocks of it); 0 while none is built (an encode-only instance: it caches no prefix)."""
        engine = self._lm_engine()
        return engine.config.block_size if engine is not None else 0

    def _lm_engine(self):
        """Its first engine that runs the LM (holds request KV); None on an encode-only instance."""
        return next((w.engine for w in self.workers if w.engine is not None and w.engine.config.computes), None)

    def dtype_line(self) -> str:
        """The dtype its engines run and why ("bfloat16 (auto: this CPU has AVX512-BF16)")."""
        if self.model is None:
            return "none"
        return f"{self.model.dtype_name} ({self.model.dtype_why})"

    def graphs_line(self) -> str:
        """Whether its LM engines replay decode graphs: "on (12 keys, 1.4 s)" or "off (why)"."""
        engine = self._lm_engine()
        if engine is None:
            return "none"
        g = engine.runner.graph_report()
        return f"on ({g['keys']} keys, {g['capture_s']:.1f} s)" if g["graphs"] else f"off ({g['why_off']})"

    def weights_method(self) -> str:
        """How the LM's attention and MLP weights are held: the quantization method, else the dtype. A
        sparse (MoE) model's quantized run names its experts' method too ("int8(experts:int8)"); an
        msModelSlim checkpoint of several types says which is where ("ascend(qkv:...,experts:dense)")."""
        if self.model is None:
            return "none"
        if not self.model.quantization:
            return self.model.dtype_name
        from epdserve.engine.lm.linear import method_of

        layers = self.model.lm.layers or []
        moe = next((w.moe for w in layers if w.moe is not None), None)
        parts = [("experts", getattr(moe, "method", "dense"))] if moe is not None else []
        if self.model.quantization == "ascend" and layers:  # several types: say which is where
            parts = [(n, method_of(getattr(layers[0], n))) for n in ("qkv", "o", "gate_up", "down")
                     if getattr(layers[0], n, None) is not None] + parts
        return self.model.quantization + ("(" + ",".join(f"{n}:{m}" for n, m in parts) + ")" if parts else "")

    def _kv_layout(self) -> common_pb2.KvLayout | None:
        """The registration record of the KV its engines hold (epdserve/kv_layout.py); None while
        none is built (an encode-only instance)."""
        engine = self._lm_engine()
        return common_pb2.KvLayout(**engine.kv_layout().to_dict()) if engine is not None else None

    def status(self) -> common_pb2.InstanceStatus:
        cfg = self.config
        load = sum_loads([w.load for w in self.workers])
        st = common_pb2.InstanceStatus(
            instance_id=self.instance_id, roles=self.roles, address=f"{cfg.host}:{self.port}", model=cfg.model,
            load=load, pid=os.getpid(), draining=self.draining,
            compute=self._compute, block_size=self._block_size(), kv_layout=self._kv_layout(),
        )
        if self.model is not None:
            st.media_namespace = self.model.namespace
        if self._serves_pairs:  # the pair store: our own port (KvStore), with its credentials
            st.kv_endpoint.CopyFrom(common_pb2.KvEndpoint(
                backend=self.model.platform.dist_backend, host=cfg.host, port=self.port))
        return st


def _close_features(workers) -> None:
    for w in workers:
        if w.engine is not None and w.engine.features is not None:
            w.engine.features.close()
