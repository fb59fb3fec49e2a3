"""One attempt at a request on one set of instances (a `Plan`): the RPC choreography.

Coupled (PD/EPD instance): `Generate`, streaming TokenDelta. Disaggregated: `Decode`
(bidirectional) on D first for a KV reservation, then `Prefill` on P with it, then
`DecodeStart` on D and its deltas (instance.proto spells the protocol out). Media to encode go
to their E instances as concurrent `Encode` calls whose answers only feed usage and timing;
a failed Encode costs nothing but P's bounded wait (P recomputes the features).

`Attempt.run()` yields `Piece`s (new tokens of choice `Piece.index`; with sampling.n > 1 the
attempt serves the n choices as one group, and ends once every one finished) and raises
`InstanceError` when an instance fails (or is killed because the registry marked it DOWN).
`close()` cancels every live call and sends `Abort` for the attempt's id to every instance it
touched, in the background (idempotent; also the path when the client cancels).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

import grpc

from epdserve.rpc import common_pb2, instance_pb2
from epdserve.scheduler.channels import ChannelPool
from epdserve.scheduler.errors import InstanceError
from epdserve.scheduler.registry import InstanceRecord, InstanceRegistry
from epdserve.scheduler.routing import Plan, WorkLease

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0
ENCODE_GRACE_S = 2.0  # after the request finished, how long usage waits for Encode answers


@dataclass
class Piece:
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str = ""
    logprobs: list = field(default_factory=list)  # common.TokenLogprobs per token, when the request asks
    index: int = 0  # the choice (sampling.n > 1) these tokens belong to


@dataclass
class AttemptInputs:
    request_id: str  # per attempt: "<public id>#<n>"
    prompt_token_ids: list[int]
    media: list[instance_pb2.MediaRef]
    sampling: common_pb2.SamplingParams
    num_vision_tokens: int
    deadline: float | None = None  # time.monotonic() bound, from the client's deadline
    cache_salt: str = ""  # the request's (security/tenants.py `cache_salt`): folded into its first KV block
    tenant: instance_pb2.TenantShare | None = None  # whose it is and its weight: instances admit by fair share


@dataclass
class AttemptReport:
    """What the attempt learned, for usage and timing."""

    timings: common_pb2.StageTimings = field(default_factory=common_pb2.StageTimings)
    already_stored: dict[str, bool] = field(default_factory=dict)  # E's answers: key -> found in store
    recomputed: set[str] = field(default_factory=set)  # P encoded these itself
    reported_cached_tokens: int = 0  # the prefilling instance's own count
    kv_cached_tokens: int = 0  # prompt tokens whose KV the prefilling instance took from its prefix cache


def merge_timings(into: common_pb2.StageTimings, new: common_pb2.StageTimings) -> None:
    """Field-wise: the first nonzero value wins (stages report their own fields), except
    `encode_end`: the latest one (a request's media spread over several E instances are encoded
    when the last of them is; pipelined prefill may start before it)."""
    for f in common_pb2.StageTimings.DESCRIPTOR.fields:
        v = getattr(new, f.name)
        if v and (not getattr(into, f.name) or (f.name == "encode_end" and v > getattr(into, f.name))):
            setattr(into, f.name, v)


def _identity_only(m: instance_pb2.MediaRef) -> instance_pb2.MediaRef:
    """A media reference without its bytes: what D's prefix cache keys imported KV by."""
    out = instance_pb2.MediaRef()
    out.CopyFrom(m)
    out.ClearField("data")
    return out


class Attempt:
    def __init__(self, inputs: AttemptInputs, plan: Plan, lease: WorkLease, channels: ChannelPool,
                 registry: InstanceRegistry, background: set):
        self.inputs, self.plan, self.lease = inputs, plan, lease
        self.channels, self.registry = channels, registry
        self.report = AttemptReport()
        self.encoded_keys: set[str] = set()  # media keys sent to E in this attempt
        self._background = background  # the dispatcher's set of fire-and-forget tasks
        self._calls: list = []
        self._encode_tasks: list[asyncio.Task] = []
        self._killed: InstanceError | None = None
        self._kill_signal: asyncio.Future | None = None  # resolved by kill(): wakes a pending `_send`
        self._prefill_done = False  # P answered: the rest is D's (a P that goes now costs nothing)
        self._closed = False

    @property
    def choices(self) -> int:
        """How many choices this attempt serves as one group (sampling.n)."""
        return max(1, self.inputs.sampling.n)

    # ---------------------------------------------------------------- driving
    async def run(self) -> AsyncIterator[Piece]:
        for rec, items in self.plan.encodes:  # tasks in plan.encodes' order
            self._encode_tasks.append(asyncio.create_task(self._encode(rec, items)))
        if self.plan.coupled is not None:
            async for piece in self._run_coupled(self.plan.coupled):
                yield piece
        else:
            async for piece in self._run_disaggregated(self.plan.prefill, self.plan.decode):
                yield piece

    async def _run_coupled(self, rec: InstanceRecord) -> AsyncIterator[Piece]:
        i = self.inputs
        call = self.channels.get(rec.address).instance.Generate(
            instance_pb2.InstanceGenerateRequest(
                request_id=i.request_id, prompt_token_ids=i.prompt_token_ids, media=i.media, sampling=i.sampling,
                cache_salt=i.cache_salt, tenant=i.tenant),
            timeout=self._timeout(),
        )
        self._calls.append(call)
        first, unfinished = True, self.choices
        while True:
            d = await self._rpc(rec, "generate", call.read())
            if d is grpc.aio.EOF:
                raise InstanceError(rec.instance_id, "generate", grpc.StatusCode.ABORTED,
                                    "stream ended before the request finished")
            merge_timings(self.report.timings, d.timings)
            if d.finished or (first and d.token_ids):
                first = False
                self.report.reported_cached_tokens = d.num_cached_vision_tokens
                self.report.kv_cached_tokens = d.num_cached_tokens
            piece = self._piece(rec, "generate", d)
            unfinished -= int(piece.finished)
            yield piece
            if not unfinished:
                return

    async def _run_disaggregated(self, p: InstanceRecord, d: InstanceRecord) -> AsyncIterator[Piece]:
        i = self.inputs
        call = self.channels.get(d.address).instance.Decode(timeout=self._timeout())
        self._calls.append(call)
        reserve = instance_pb2.DecodeReserve(
            request_id=i.request_id, prompt_token_ids=i.prompt_token_ids, sampling=i.sampling,
            num_vision_tokens=i.num_vision_tokens, prefill_instance_id=p.instance_id,
            prefill_kv_endpoint=p.kv_endpoint, media=[_identity_only(m) for m in i.media], cache_salt=i.cache_salt,
            tenant=i.tenant, prefill_tensor_parallel_size=p.kv_layout.degree if p.kv_layout else 1,
        )
        await self._send(d, "decode", call.write(instance_pb2.DecodeInput(reserve=reserve)))
        out = await self._rpc(d, "decode", call.read())
        if out is grpc.aio.EOF or not out.HasField("reserved"):
            raise InstanceError(d.instance_id, "decode", grpc.StatusCode.ABORTED, "no KV reservation from D")
        prefill = self.channels.get(p.address).instance.Prefill(
            instance_pb2.PrefillRequest(
                request_id=i.request_id, prompt_token_ids=i.prompt_token_ids, media=i.media,
                sampling=i.sampling, decode=out.reserved, cache_salt=i.cache_salt, tenant=i.tenant),
            timeout=self._timeout(),
        )
        self._calls.append(prefill)
        resp = await self._rpc(p, "prefill", prefill)
        self._prefill_done = True
        self.lease.done("P")
        merge_timings(self.report.timings, resp.timings)
        self.report.recomputed.update(resp.recomputed_keys)
        self.report.reported_cached_tokens = resp.num_cached_vision_tokens
        self.report.kv_cached_tokens = resp.num_cached_tokens
        if len(resp.choices) != self.choices - 1:
            raise InstanceError(p.instance_id, "prefill", grpc.StatusCode.ABORTED,
                                f"{len(resp.choices) + 1} first tokens for {self.choices} choices")
        pieces = [Piece([resp.first_token_id], resp.first_text, bool(resp.finish_reason), resp.finish_reason,
                        [resp.first_logprobs] if resp.HasField("first_logprobs") else [])]
        pieces += [Piece([c.token_id], c.text, bool(c.finish_reason), c.finish_reason,
                         [c.logprobs] if c.HasField("logprobs") else [], c.index) for c in resp.choices]
        done = {x.index for x in pieces if x.finished}
        for piece in pieces:
            yield piece
        if len(done) == self.choices:
            self.close(abort=True)  # D frees its reservation, P its KV
            return
        start = instance_pb2.DecodeStart(first_token_id=resp.first_token_id, rope_delta=resp.rope_delta,
                                         choice_first_token_ids=[c.token_id for c in resp.choices])
        await self._send(d, "decode", call.write(instance_pb2.DecodeInput(start=start)))
        await self._send(d, "decode", call.done_writing())
        while True:
            out = await self._rpc(d, "decode", call.read())
            if out is grpc.aio.EOF:
                raise InstanceError(d.instance_id, "decode", grpc.StatusCode.ABORTED,
                                    "stream ended before the request finished")
            if not out.HasField("delta"):
                continue
            merge_timings(self.report.timings, out.delta.timings)
            piece = self._piece(d, "decode", out.delta)
            if piece.index in done:  # ended by its first token at P: D ends it too, with nothing new
                continue
            if piece.finished:
                done.add(piece.index)
            yield piece
            if len(done) == self.choices:
                return

    async def _encode(self, rec: InstanceRecord, items: list[int]) -> None:
        req = instance_pb2.EncodeRequest(
            request_id=self.inputs.request_id, media=[self.inputs.media[k] for k in items],
            target_instance_id=self.plan.target.instance_id, tenant=self.inputs.tenant,
        )
        call = self.channels.get(rec.address).instance.Encode(req, timeout=self._timeout())
        self._calls.append(call)
        try:
            resp = await call
        except grpc.aio.AioRpcError as e:
            log.warning("encode of %s on %s failed (%s: %s); the prefill instance will recompute",
                        self.inputs.request_id, rec.instance_id, e.code().name, e.details())
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
                self.registry.record_failure(rec.instance_id, f"encode: {e.code().name}")
            return
        finally:
            self.lease.done("E")
        merge_timings(self.report.timings, resp.timings)
        for m in resp.media:
            self.report.already_stored[m.key] = m.already_stored

    async def encode_results(self) -> None:
        """Wait (briefly) for the Encode answers, for usage."""
        if self._encode_tasks:
            await asyncio.wait(self._encode_tasks, timeout=ENCODE_GRACE_S)

    # ---------------------------------------------------------------- failure and cleanup
    def kill(self, instance_id: str, reason: str) -> None:
        """`instance_id` is gone (down, or deregistered after a role switch): abandon the attempt if
        it still owes the attempt work — live calls then fail as InstanceError and the request is
        retried. An instance whose part is over costs nothing: an E only has its Encode cancelled
        (P recomputes features that never came), a P whose Prefill answered leaves D decoding (D
        fails the request itself if the KV did not all arrive)."""
        if self._killed is not None or all(r.instance_id != instance_id for r in self.plan.instances()):
            return
        if not self._owes_work(instance_id):
            for (rec, _), task in zip(self.plan.encodes, self._encode_tasks):
                if rec.instance_id == instance_id:
                    task.cancel()
            log.debug("%s: %s left (%s) after its part; the attempt carries on", self.inputs.request_id,
                      instance_id, reason)
            return
        self.cancel(InstanceError(instance_id, "attempt", grpc.StatusCode.UNAVAILABLE, reason))

    def cancel(self, error: InstanceError) -> None:
        """Abandon the attempt now (whatever its instances owe): live calls fail with `error`."""
        if self._killed is not None:
            return
        self._killed = error
        for call in self._calls:
            call.cancel()
        if self._kill_signal is not None and not self._kill_signal.done():
            self._kill_signal.set_result(None)  # wakes a `_send` that call.cancel() does not (see there)

    def _owes_work(self, instance_id: str) -> bool:
        p = self.plan
        if any(r is not None and r.instance_id == instance_id for r in (p.coupled, p.decode)):
            return True
        return p.prefill is not None and p.prefill.instance_id == instance_id and not self._prefill_done

    def close(self, abort: bool) -> None:
        """Cancel live calls; with `abort`, tell every instance to drop the attempt (background)."""
        if self._closed:
            return
        self._closed = True
        for call in self._calls:
            call.cancel()
        for t in self._encode_tasks:
            t.cancel()
        self.lease.release()
        if abort:
            for rec in self.plan.instances():
                task = asyncio.get_running_loop().create_task(self._send_abort(rec))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _send_abort(self, rec: InstanceRecord) -> None:
        try:
            await self.channels.get(rec.address).instance.Abort(
                instance_pb2.InstanceAbortRequest(request_id=self.inputs.request_id), timeout=ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.debug("abort of %s on %s failed: %s", self.inputs.request_id, rec.instance_id, e.code().name)

    # ---------------------------------------------------------------- helpers
    async def _rpc(self, rec: InstanceRecord, stage: str, awaitable: Awaitable):
        if self._killed is not None:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise self._killed
        try:
            return await awaitable
        except grpc.aio.AioRpcError as e:
            if self._killed is not None:
                raise self._killed from None
            raise InstanceError.from_rpc(rec.instance_id, stage, e) from None
        except asyncio.InvalidStateError as e:  # a write to a stream the dead peer already ended
            if self._killed is not None:
                raise self._killed from None
            raise InstanceError(rec.instance_id, stage, grpc.StatusCode.UNAVAILABLE, f"stream ended: {e}") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._killed is not None and not (task and task.cancelling()):
                raise self._killed from None
            raise

    async def _send(self, rec: InstanceRecord, stage: str, awaitable: Awaitable):
        """`_rpc` for a write on a request stream (`write`, `done_writing`), raced against `kill()`:
        grpc.aio's stream write waits for the call's initial metadata to be sent and never wakes when
        the call is cancelled before that (a D that died while its Decode stream was being opened:
        the write hung forever and its request with it). Reads wake on cancel, so only writes race."""
        if self._killed is not None:
            awaitable.close()
            raise self._killed
        return await self._rpc(rec, stage, self._until_killed(awaitable))

    async def _until_killed(self, awaitable: Awaitable):
        if self._kill_signal is None:
            self._kill_signal = asyncio.get_running_loop().create_future()
        step = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait((step, self._kill_signal), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            step.cancel()
            raise
        if not step.done():
            step.cancel()
            raise self._killed
        return step.result()

    def _piece(self, rec: InstanceRecord, stage: str, d: instance_pb2.TokenDelta) -> Piece:
        if d.finished and d.finish_reason not in ("stop", "length"):
            # abort/error we did not ask for (instance draining, KV import failed): retry
            raise InstanceError(rec.instance_id, stage, grpc.StatusCode.ABORTED,
                                f"instance ended the request with {d.finish_reason or 'no reason'}")
        return Piece(list(d.token_ids), d.text, d.finished, d.finish_reason, list(d.logprobs), d.index)

    def _timeout(self) -> float | None:
        if self.inputs.deadline is None:
            return None
        return max(0.001, self.inputs.deadline - time.monotonic())
