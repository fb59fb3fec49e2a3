"""Drive instance processes' `Instance` service the way the scheduler does (E → D reserve → P → D start)."""
from __future__ import annotations

import queue

import grpc

from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.processor import MultimodalProcessor
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc
from epdserve.seams.media_keys import MediaKeySecret, media_key
from tests.harness import PH, wait_until  # noqa: F401 - re-exported to the package's tests


def image(seed: int, w: int = 112, h: int = 84) -> bytes:
    return jpeg_bytes(procedural_image(w, h, seed=seed))


def stub(address: str, cluster_token: str | None = None) -> instance_pb2_grpc.InstanceStub:
    """An Instance stub; `cluster_token`: sent on every call (a launched deployment's instances need it)."""
    channel = grpc.insecure_channel(address)
    if cluster_token is not None:
        from epdserve.security import Secret
        from epdserve.security.interceptors import cluster_metadata, metadata_interceptors

        channel = grpc.intercept_channel(channel, *metadata_interceptors(cluster_metadata(Secret(cluster_token))))
    return instance_pb2_grpc.InstanceStub(channel)


def status(s) -> common_pb2.InstanceStatus:
    return s.GetLoad(instance_pb2.GetLoadRequest(), timeout=10)


class Prepared:
    """A request as the scheduler would send it: expanded token ids and media refs."""

    def __init__(self, processor: MultimodalProcessor, namespace: str, prompt: str, images: list[bytes],
                 expect_features: bool = True):
        p = processor.process(prompt, images)
        self.token_ids = list(p.token_ids)
        self.refs = [instance_pb2.MediaRef(key=media_key(m.raw, namespace, MediaKeySecret.of_process()), data=m.raw,
                                           grid_thw=[int(x) for x in m.grid_thw], num_tokens=m.num_tokens,
                                           expect_features=expect_features) for m in p.media]
        self.num_vision_tokens = sum(m.num_tokens for m in p.media)


def encode(e_stub, rid: str, req: Prepared, target: str) -> instance_pb2.EncodeResponse:
    return e_stub.Encode(instance_pb2.EncodeRequest(request_id=rid, media=req.refs, target_instance_id=target),
                         timeout=60)


class DecodeCall:
    """One Decode call: reserve on open, `start` later, iterate the deltas."""

    def __init__(self, d_stub, rid: str, req: Prepared, sampling, p_status):
        self._inputs: queue.Queue = queue.Queue()
        self._inputs.put(instance_pb2.DecodeInput(reserve=instance_pb2.DecodeReserve(
            request_id=rid, prompt_token_ids=req.token_ids, sampling=sampling,
            num_vision_tokens=req.num_vision_tokens, prefill_instance_id=p_status.instance_id,
            prefill_kv_endpoint=p_status.kv_endpoint)))
        self.call = d_stub.Decode(iter(self._inputs.get, None), timeout=120)
        first = next(self.call)
        assert first.WhichOneof("kind") == "reserved"
        self.reservation = first.reserved

    def start(self, first_token: int, rope_delta: int) -> None:
        self._inputs.put(instance_pb2.DecodeInput(start=instance_pb2.DecodeStart(
            first_token_id=first_token, rope_delta=rope_delta)))

    def close(self) -> None:
        self._inputs.put(None)

    def deltas(self):
        for out in self.call:
            yield out.delta


def run_disaggregated(e_stub, p_stub, d_stub, rid: str, req: Prepared, sampling, p_status, encode_first=True):
    """The whole E → P → D path; returns (token ids, prefill response, last delta, encode response)."""
    enc = encode(e_stub, rid, req, p_status.instance_id) if (encode_first and req.refs) else None
    dec = DecodeCall(d_stub, rid, req, sampling, p_status)
    pre = p_stub.Prefill(instance_pb2.PrefillRequest(request_id=rid, prompt_token_ids=req.token_ids, media=req.refs,
                                                     sampling=sampling, decode=dec.reservation), timeout=120)
    tokens = [pre.first_token_id]
    last = None
    if pre.finish_reason:
        dec.close()
        return tokens, pre, last, enc
    dec.start(pre.first_token_id, pre.rope_delta)
    for last in dec.deltas():
        tokens += list(last.token_ids)
        if last.finished:
            break
    dec.close()
    return tokens, pre, last, enc


