"""The scheduler's gRPC servicers: public `EPDServe` (clients) and `Registry` (instances).

Both run on the scheduler's asyncio event loop. A `RequestError` becomes its status code; an
unexpected exception becomes INTERNAL for that request only (logged with its traceback; the client
reads the error's type and the request id, `internal_error`), never a crashed server. The
metrics observer on `generate` counts every one of them by status.
"""
from __future__ import annotations

import logging
import time

import grpc

from epdserve.instance.modes import mode_of_roles
from epdserve.roles import STAGES
from epdserve.rpc import instance_pb2, instance_pb2_grpc, serve_pb2, serve_pb2_grpc
from epdserve.scheduler.config import SchedulerConfig
from epdserve.scheduler.dispatcher import Dispatcher
from epdserve.scheduler.errors import RequestError
from epdserve.scheduler.preprocess import IMAGE_PLACEHOLDER
from epdserve.scheduler.registry import InstanceRegistry, RegistryError
from epdserve.security.tenants import DEFAULT_TENANT
from epdserve.scheduler.upload_service import to_proto

log = logging.getLogger(__name__)


def internal_error(request, e: BaseException) -> str:
    """Log an unexpected failure of `request` (with its traceback) and say it to the client without
    the exception's text (which may hold object reprs or internals): the error's type and where
    the details are."""
    rid = request.request_id or "(unnamed)"
    log.exception("request %s failed", rid)
    return f"internal error in the scheduler ({type(e).__name__}) serving request {rid}; its log has the details"


def caller_tenant(context, tenant_of=None) -> str:
    """The tenant of a gRPC caller: the one its API key names (`SchedulerSecurity.tenant_of`;
    the auth interceptor refused every other caller before the servicer ran), else the default."""
    if tenant_of is None:
        return DEFAULT_TENANT
    tenant = tenant_of(context.invocation_metadata())
    return DEFAULT_TENANT if tenant is None else tenant


def _deadline(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class EPDServeServicer(serve_pb2_grpc.EPDServeServicer):
    def __init__(self, config: SchedulerConfig, dispatcher: Dispatcher, registry: InstanceRegistry, info: dict,
                 generate=None, may_see_addresses=None, tenant_of=None, multi_tenant: bool = False):
        self.config = config
        self.dispatcher = dispatcher
        self.generate = generate or dispatcher.generate  # SchedulerServer.generate: the observed path
        self.may_see_addresses = may_see_addresses or (lambda metadata: True)  # the cluster token holders
        self.registry = registry
        self.info = info  # scheduler_id, address, started_at, version
        self.tenant_of = tenant_of  # metadata -> tenant (SchedulerSecurity.tenant_of); None: one tenant
        self.multi_tenant = multi_tenant  # a keys file names tenants: shared counters are for token holders only

    def _generate(self, request, context):
        return self.generate(request, _deadline(context), caller_tenant(context, self.tenant_of))

    async def GenerateStream(self, request, context):
        try:
            async for delta in self._generate(request, context):
                yield delta
        except RequestError as e:
            await context.abort(e.code, e.message)
        except Exception as e:
            await context.abort(grpc.StatusCode.INTERNAL, internal_error(request, e))

    async def Generate(self, request, context):
        out = serve_pb2.GenerateResponse()
        if request.sampling.n > 1:  # one response holds one choice: n of them stream (each message its index)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "sampling.n > 1 is served by GenerateStream (each choice's messages carry its index)")
        try:
            async for d in self._generate(request, context):
                out.request_id = d.request_id
                out.token_ids.extend(d.token_ids)
                out.logprobs.extend(d.logprobs)
                out.text += d.text
                if d.finished:
                    out.finish_reason = d.finish_reason
                    out.usage.CopyFrom(d.usage)
                    out.timing.CopyFrom(d.timing)
                    out.media_keys.extend(d.media_keys)
        except RequestError as e:
            await context.abort(e.code, e.message)
        except Exception as e:
            await context.abort(grpc.StatusCode.INTERNAL, internal_error(request, e))
        return out

    async def Abort(self, request, context):
        return serve_pb2.AbortResponse(found=self.dispatcher.abort(request.request_id,
                                                                   caller_tenant(context, self.tenant_of)))

    async def UploadMedia(self, request, context):
        try:
            f = await self.dispatcher.uploads.upload(bytes(request.data), caller_tenant(context, self.tenant_of), request.filename)
        except RequestError as e:
            await context.abort(e.code, e.message)
        return to_proto(f)

    async def GetUpload(self, request, context):
        try:
            return to_proto(self.dispatcher.uploads.get(caller_tenant(context, self.tenant_of), request.file_id))
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def DeleteUpload(self, request, context):
        try:
            await self.dispatcher.uploads.delete(caller_tenant(context, self.tenant_of), request.file_id)
        except RequestError as e:
            await context.abort(e.code, e.message)
        return serve_pb2.DeleteUploadResponse(deleted=True)

    async def GetModelInfo(self, request, context):
        pp = self.dispatcher.preprocessor
        return serve_pb2.ModelInfo(
            model=self.config.model, model_type=pp.model_type, media_namespace=self.registry.namespace,
            max_model_len=pp.max_model_len, image_placeholder=IMAGE_PLACEHOLDER, image_token_id=pp.image_token_id,
            eos_token_ids=pp.eos_token_ids, vocab_size=pp.vocab_size,
        )

    async def GetServerInfo(self, request, context):
        records = list(self.registry.records())
        insider = self.may_see_addresses(context.invocation_metadata())
        queried = sum(r.load.prefix_queried_tokens for r in records)
        return serve_pb2.ServerInfo(
            version=self.info["version"], scheduler_id=self.info["scheduler_id"], address=self.info["address"],
            started_at=self.info["started_at"], requests_in_flight=self.dispatcher.in_flight,
            instances=[self._status(r, insider) for r in records],
            mode=self.config.mode or self._mode(),
            prefix_cache_hit_rate=sum(r.load.prefix_hit_tokens for r in records) / queried
            if queried and (insider or not self.multi_tenant) else 0.0,
        )

    def _status(self, record, insider: bool):
        """An instance as a caller may see it: whole for a cluster-token holder; for anyone else
        without where it runs (address, KV endpoint, pid, host name, model path) and, where tenants
        share the deployment, without the prefix-cache counters and the feature cache's hit rate,
        which count every tenant's hits (an oracle of the others' prompts and images)."""
        st = record.to_proto()
        if not insider:
            for name in ("address", "kv_endpoint", "pid", "model"):
                st.ClearField(name)
            st.compute = st.compute.split("@", 1)[0]  # the device, not the host's name
            if self.multi_tenant:
                for name in ("prefix_queried_tokens", "prefix_hit_tokens", "prefix_cache_hit_rate", "mm_cache_hit_rate"):
                    st.load.ClearField(name)
        return st

    def _mode(self) -> str:
        """The deployment mode the roster's roles add up to (instance/modes.py), else its role
        sets joined, e.g. "E-P" while instances are still registering."""
        roles = {r.roles for r in self.registry.records()}
        return mode_of_roles(roles) or "-".join(sorted(roles, key=lambda x: (STAGES.index(x[0]), x)))


class RegistryServicer(instance_pb2_grpc.RegistryServicer):
    def __init__(self, config: SchedulerConfig, registry: InstanceRegistry, scheduler_id: str):
        self.config = config
        self.registry = registry
        self.scheduler_id = scheduler_id

    async def Register(self, request, context):
        try:
            self.registry.register(request.instance)
        except RegistryError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return instance_pb2.RegisterResponse(scheduler_id=self.scheduler_id,
                                             heartbeat_interval_s=self.config.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        load = request.load if request.HasField("load") else None
        return instance_pb2.HeartbeatResponse(known=self.registry.heartbeat(request.instance_id, load))

    async def Deregister(self, request, context):
        self.registry.deregister(request.instance_id)
        return instance_pb2.DeregisterResponse()
