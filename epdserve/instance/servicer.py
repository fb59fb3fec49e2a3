"""The `Instance` gRPC service of one instance process: routes each RPC to its stage worker.

RPC → worker: Encode → E, Prefill → P, Decode → D, Generate → the coupled (PD/EPD) worker,
DropMedia → E (features of a deleted upload leave the MM Store);
KvStore → the host's KV pair store (decode peers rendezvous and read batch headers there).
An RPC for a stage this instance does not run answers FAILED_PRECONDITION. Each handler waits
on its request's handle; a cancelled or broken call aborts the request on the worker
(`context.add_callback`). Failures map to status codes as errors.py says. A request with n > 1
choices (SamplingParams.n, one sequence group): Generate and Decode stream each choice's tokens
under its index and end after all n finished; Prefill answers once all n first tokens are out.
"""
from __future__ import annotations

import logging
import queue
import time

import grpc

from epdserve.instance import convert
from epdserve.instance.decode_worker import media_identity
from epdserve.engine.engine_request import EngineRequest
from epdserve.instance.errors import TransientError, status_for
from epdserve.instance.sampling_wire import sampling_from_proto
from epdserve.instance.worker import CALL_TIMEOUT_S
from epdserve.request_errors import InvalidRequestError
from epdserve.rpc import instance_pb2, instance_pb2_grpc
from epdserve.seams.kv_connector import RemoteDecode
from epdserve.transfer.kv import PairRendezvous
from epdserve.transfer.kv.store_service import serve_kv_store

log = logging.getLogger(__name__)

_WAIT_S = 1.0  # how often a waiting handler checks that its call is still alive


class InstanceServicer(instance_pb2_grpc.InstanceServicer):
    def __init__(self, host):
        self.host = host  # InstanceHost: workers by role, status

    # ---------------------------------------------------------------- helpers
    def _worker(self, role: str, context):
        w = self.host.worker(role)
        if w is None and self.host.switch_lock.locked():  # routed before our role switch was announced
            context.abort(grpc.StatusCode.ABORTED, f"instance {self.host.instance_id} is switching roles; retry elsewhere")
        if w is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"instance {self.host.instance_id} ({self.host.roles}) does not run stage {role}")
        return w

    @staticmethod
    def _fail(context, exc: BaseException):
        context.abort(status_for(exc), str(exc) or type(exc).__name__)

    def _wait(self, handle, context):
        """The request's next event; aborts the call with the right status on an error."""
        while True:
            try:
                ev = handle.get(_WAIT_S)
            except queue.Empty:
                if not context.is_active():
                    self._fail(context, TransientError("call ended"))
                continue
            if isinstance(ev, BaseException):
                self._fail(context, ev)
            return ev

    def _next_deltas(self, handle, context, streamed: bool, unfinished: int):
        """The next stream messages' outputs: the next event and whatever else the request has
        queued, joined per choice (one output per choice index, in the order they came); once the
        request has `streamed` a token, held up to the instance's stream interval to gather more
        (the first token is never held). Stops gathering once its `unfinished` choices all ended."""
        outs = [self._wait(handle, context)]
        ended = int(outs[-1].finished)
        hold = self.host.config.stream_interval_ms / 1e3 if streamed else 0.0
        deadline = time.monotonic() + hold
        while ended < unfinished:
            left = deadline - time.monotonic()
            try:
                ev = handle.get(left) if left > 0 else handle.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, BaseException):
                self._fail(context, ev)
            outs.append(ev)
            ended += int(ev.finished)
        by_index: dict[int, list] = {}
        for o in outs:
            by_index.setdefault(o.index, []).append(o)
        return [convert.coalesce(group) for group in by_index.values()]

    def _guard(self, context, fn):
        try:
            return fn()
        except (InvalidRequestError, TransientError, ValueError, MemoryError, RuntimeError, TimeoutError) as e:
            if isinstance(e, ValueError) and not isinstance(e, InvalidRequestError):
                e = InvalidRequestError(str(e))
            self._fail(context, e)

    # ---------------------------------------------------------------- E
    def Encode(self, request, context):
        w = self._worker("E", context)
        rid = request.request_id
        items = self._guard(context, lambda: convert.media_items(w.engine, request.media))
        handle = self._guard(context, lambda: w.encode(rid, items, request.target_instance_id,
                                                       convert.tenant_share(request.tenant)))
        context.add_callback(lambda: w.abort(rid))
        out = self._wait(handle, context)
        return instance_pb2.EncodeResponse(
            media=[instance_pb2.EncodedMedia(key=m.key, already_stored=m.from_store, num_tokens=m.num_tokens)
                   for m in items],
            timings=convert.timings_to_proto(out.timings),
        )

    # ---------------------------------------------------------------- P
    def Prefill(self, request, context):
        w = self._worker("P", context)
        rid, dec = request.request_id, request.decode
        if not dec.decode_instance_id or not dec.pair.port:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PrefillRequest.decode (the D reservation) is missing")
        if dec.block_size and dec.block_size != w.engine.config.block_size:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"decode instance uses block size {dec.block_size}, "
                          f"this prefill instance {w.engine.config.block_size}")

        def job():
            return EngineRequest(
                request_id=rid,
                prompt_token_ids=list(request.prompt_token_ids),
                media=convert.media_items(w.engine, request.media),
                params=sampling_from_proto(request.sampling),
                kv_transfer=RemoteDecode(dec.decode_instance_id, tuple(dec.dst_block_ids), dec.num_cached_tokens),
                cache_salt=request.cache_salt, tenant=convert.tenant_share(request.tenant),
            )

        j = self._guard(context, job)
        rdzv = self._guard(context, lambda: PairRendezvous(dec.pair.host, int(dec.pair.port), dec.pair.pair_name, 0,
                                                           dec.pair.p_degree or 1, dec.pair.d_degree or 1))
        handle = self._guard(context, lambda: w.prefill(j, rdzv))
        context.add_callback(lambda: w.abort(rid))
        outs = {}  # choice index -> its output (each ends here: handed off, or finished by its first token)
        while len(outs) < j.params.n:
            o = self._wait(handle, context)
            outs[o.index] = o
        out = outs[0]
        first = out.token_ids[0] if out.token_ids else 0
        t = dict(out.timings)
        t.setdefault("prefill_start", t.get("encode_end") or t.get("arrival", 0.0))
        resp = instance_pb2.PrefillResponse(
            request_id=rid,
            first_token_id=first,
            first_text=out.text,
            finish_reason=out.finish_reason or "",
            rope_delta=out.rope_delta,
            num_prompt_tokens=out.num_prompt_tokens,
            num_vision_tokens=out.num_vision_tokens,
            num_cached_vision_tokens=out.num_cached_vision_tokens,
            num_cached_tokens=out.num_cached_tokens,
            recomputed_keys=out.encoded_keys,
            timings=convert.timings_to_proto(t),
        )
        if out.new_logprobs:  # the first token's, sampled here (it reaches the client through the scheduler)
            resp.first_logprobs.CopyFrom(convert.logprobs_to_proto(out.new_logprobs[0]))
        for k in range(1, j.params.n):  # the group's other choices: their first tokens go to D with the one KV
            o = outs[k]
            c = resp.choices.add(index=k, token_id=o.token_ids[0] if o.token_ids else 0, text=o.text,
                                 finish_reason=o.finish_reason or "")
            if o.new_logprobs:
                c.logprobs.CopyFrom(convert.logprobs_to_proto(o.new_logprobs[0]))
        return resp

    # ---------------------------------------------------------------- D
    def Decode(self, request_iterator, context):
        w = self._worker("D", context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "reserve":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Decode call starts with DecodeInput.reserve")
        r = first.reserve
        rid = r.request_id
        params = self._guard(context, lambda: sampling_from_proto(r.sampling))
        ep = r.prefill_kv_endpoint
        if not r.prefill_instance_id or not ep.port:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "DecodeReserve needs prefill_instance_id and prefill_kv_endpoint")
        handle, res = self._guard(context, lambda: w.reserve(
            rid, list(r.prompt_token_ids), params, r.prefill_instance_id, ep.host, int(ep.port), r.num_vision_tokens,
            media_identity(r.media), r.cache_salt, convert.tenant_share(r.tenant), r.prefill_tensor_parallel_size or 1))
        context.add_callback(lambda: w.abort(rid))
        yield instance_pb2.DecodeOutput(reserved=instance_pb2.KvReservation(
            decode_instance_id=self.host.instance_id,
            dst_block_ids=list(res.block_ids),
            block_size=res.block_size,
            num_cached_tokens=res.num_cached_tokens,
            pair=instance_pb2.KvPair(host=res.rdzv.host, port=res.rdzv.port, pair_name=res.rdzv.pair_name,
                                     p_degree=res.rdzv.p_degree, d_degree=res.rdzv.d_degree),
        ))
        nxt = next(request_iterator, None)
        if nxt is None or nxt.WhichOneof("kind") != "start":
            w.abort(rid)
            return  # the scheduler closed the call: the first token ended the request
        start = nxt.start
        self._guard(context, lambda: w.begin(rid, start.first_token_id, start.rope_delta,
                                             list(start.choice_first_token_ids)).result(CALL_TIMEOUT_S))
        unfinished = params.n  # every choice ends on D (one whose first token at P ended it too, at once)
        while unfinished:
            for out in self._next_deltas(handle, context, True, unfinished):  # D's first tokens came from P
                yield instance_pb2.DecodeOutput(delta=convert.token_delta(out, rid))
                unfinished -= int(out.finished)

    # ---------------------------------------------------------------- PD / EPD
    def Generate(self, request, context):
        w = self._worker("PD", context)
        rid = request.request_id

        def submit():
            items = convert.media_items(w.engine, request.media)
            params = sampling_from_proto(request.sampling)
            return w.submit(EngineRequest(rid, list(request.prompt_token_ids), items, params,
                                          cache_salt=request.cache_salt, tenant=convert.tenant_share(request.tenant)))

        handle = self._guard(context, submit)
        context.add_callback(lambda: w.abort(rid))
        streamed, unfinished = False, handle.n
        while unfinished:  # until every choice (SamplingParams.n) finished
            for out in self._next_deltas(handle, context, streamed, unfinished):
                streamed = streamed or bool(out.new_token_ids)
                extra = {}
                if out.token_ids and "first_token" in out.timings:
                    extra["prefill_start"] = out.timings.get("encode_end") or out.timings.get("arrival", 0.0)
                yield convert.token_delta(out, rid, **extra)
                unfinished -= int(out.finished)

    # ---------------------------------------------------------------- control
    def Abort(self, request, context):
        found = False
        for w in self.host.all_workers():
            try:
                found = bool(w.abort(request.request_id).result(timeout=10)) or found
            except Exception as e:  # a stopping worker
                log.debug("abort on %s: %s", w.name, e)
        return instance_pb2.InstanceAbortResponse(found=found)

    def GetLoad(self, request, context):
        return self.host.status()

    def DropMedia(self, request, context):
        w = self._worker("E", context)
        drop = w.engine.features.drop
        dropped = self._guard(context, lambda: w.call(lambda: sum(1 for k in request.keys if drop(k))).result(CALL_TIMEOUT_S))
        return instance_pb2.DropMediaResponse(dropped=dropped)

    def KvStore(self, request, context):
        return serve_kv_store(self.host.pair_store, request, context)

    def SwitchRoles(self, request, context):
        from epdserve.instance.role_switch import SwitchError

        try:
            r = self.host.switch_roles(request.roles, request.drain_timeout_s or 60.0, request.reason)
        except SwitchError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return instance_pb2.SwitchRolesResponse(instance=self.host.status(), previous_instance_id=r.previous_instance_id,
                                                drain_s=r.drain_s, rebuild_s=r.rebuild_s)
