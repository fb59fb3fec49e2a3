"""The `KvStore` RPC's server side: one `KvStoreRequest` applied to a `PairStoreHost`.

`serve_kv_store` is what the prefill instance's `Instance.KvStore` handler (and the standalone
`RendezvousServer`) call; it runs behind the port's interceptors, so only holders of the
cluster token (and of a client certificate, under mutual TLS) get here. Malformed requests
end INVALID_ARGUMENT, writes past the store's bounds RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import grpc

from epdserve.rpc import instance_pb2
from epdserve.transfer.kv.pair_store import PairStoreHost, StoreFull

Op = instance_pb2.KvStoreRequest
_ONE_KEY = {Op.KV_SET, Op.KV_GET, Op.KV_ADD, Op.KV_DELETE, Op.KV_COMPARE_SET, Op.KV_TAKE}


def apply(store: PairStoreHost, r) -> instance_pb2.KvStoreResponse:
    """The answer to request `r`; ValueError when it is malformed, StoreFull past the bounds."""
    out = instance_pb2.KvStoreResponse()
    pair, keys, wait_s = r.pair_name, list(r.keys), r.wait_ms / 1e3
    if r.op in _ONE_KEY and len(keys) != 1:
        raise ValueError(f"KvStore {Op.Op.Name(r.op)} takes exactly one key, got {len(keys)}")
    if r.op == Op.KV_SET:
        store.set(pair, keys[0], r.value)
    elif r.op in (Op.KV_GET, Op.KV_TAKE):
        value = (store.get if r.op == Op.KV_GET else store.take)(pair, keys[0], wait_s)
        out.found = value is not None
        out.value = value or b""
    elif r.op == Op.KV_ADD:
        out.number = store.add(pair, keys[0], r.amount)
    elif r.op == Op.KV_CHECK:
        out.found = store.check(pair, keys)
    elif r.op == Op.KV_DELETE:
        out.found = store.delete(pair, keys[0])
    elif r.op == Op.KV_WAIT:
        out.found = store.wait(pair, keys, wait_s)
    elif r.op == Op.KV_COMPARE_SET:
        out.value = store.compare_set(pair, keys[0], r.expected, r.value)
    elif r.op == Op.KV_NUM_KEYS:
        out.number = store.num_keys(pair)
    elif r.op == Op.KV_RELEASE:
        out.found = store.release(pair)
    else:
        raise ValueError(f"KvStore: unknown op {r.op}")
    return out


def serve_kv_store(store: PairStoreHost | None, request, context) -> instance_pb2.KvStoreResponse:
    """`apply`, with its errors as gRPC statuses; FAILED_PRECONDITION when `store` is None (this
    process keeps no pair store: it does not prefill for remote decode instances)."""
    if store is None:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this instance keeps no KV pair store (no P role)")
    try:
        return apply(store, request)
    except StoreFull as e:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
