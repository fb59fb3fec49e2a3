"""`PairStoreClient`: a prefill instance's `PairStoreHost`, reached from another process through
that instance's `KvStore` RPC.

Same methods as `PairStoreHost` (so `PairStore` sits on either), each one RPC on a channel of
its own to the prefill instance's gRPC address, carrying the cluster token and, under mutual
TLS, this instance's certificate (`PairNetwork` holds them). A refused or failed call raises
`DistStoreError` naming the address and the status (UNAUTHENTICATED: the token is wrong or
missing).
"""
from __future__ import annotations

import grpc
from torch.distributed import DistStoreError

from epdserve.rpc import instance_pb2, instance_pb2_grpc
from epdserve.security.interceptors import metadata_interceptors
from epdserve.transfer.kv.pair_store import MAX_WAIT_S

Op = instance_pb2.KvStoreRequest
_CALL_MARGIN_S = 10.0  # an RPC's deadline: its server-side wait plus this
_RELEASE_S = 1.0  # release is best effort (the prefill side drops the pair too): never hold a closing pair up


class PairStoreClient:
    """address: "host:port" of the prefill instance; credentials: TLS channel credentials (None:
    plaintext); metadata: (key, value) pairs sent on every call (the cluster token)."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                 metadata: list[tuple[str, str]] | None = None):
        self.address = address
        ch = grpc.secure_channel(address, credentials) if credentials is not None else grpc.insecure_channel(address)
        self._channel = ch
        self._stub = instance_pb2_grpc.InstanceStub(grpc.intercept_channel(ch, *metadata_interceptors(metadata or [])))

    def _call(self, op, pair: str, keys: list[str], wait_s: float = 0.0, margin_s: float = _CALL_MARGIN_S,
              **fields) -> instance_pb2.KvStoreResponse:
        wait_s = max(0.0, min(wait_s, MAX_WAIT_S))
        req = Op(op=op, pair_name=pair, keys=keys, wait_ms=int(wait_s * 1e3), **fields)
        try:
            return self._stub.KvStore(req, timeout=wait_s + margin_s)
        except grpc.RpcError as e:
            raise DistStoreError(f"KV pair store at {self.address}: {Op.Op.Name(op)} {pair!r} failed: "
                                 f"{e.code().name}: {e.details()}") from None

    def set(self, pair: str, key: str, value: bytes) -> None:
        self._call(Op.KV_SET, pair, [key], value=value)

    def add(self, pair: str, key: str, amount: int) -> int:
        return self._call(Op.KV_ADD, pair, [key], amount=amount).number

    def compare_set(self, pair: str, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(Op.KV_COMPARE_SET, pair, [key], expected=expected, value=desired).value

    def delete(self, pair: str, key: str) -> bool:
        return self._call(Op.KV_DELETE, pair, [key]).found

    def check(self, pair: str, keys: list[str]) -> bool:
        return self._call(Op.KV_CHECK, pair, keys).found

    def num_keys(self, pair: str) -> int:
        return self._call(Op.KV_NUM_KEYS, pair, []).number

    def wait(self, pair: str, keys: list[str], wait_s: float) -> bool:
        return self._call(Op.KV_WAIT, pair, keys, wait_s).found

    def get(self, pair: str, key: str, wait_s: float = 0.0) -> bytes | None:
        r = self._call(Op.KV_GET, pair, [key], wait_s)
        return r.value if r.found else None

    def take(self, pair: str, key: str, wait_s: float = 0.0) -> bytes | None:
        r = self._call(Op.KV_TAKE, pair, [key], wait_s)
        return r.value if r.found else None

    def release(self, pair: str) -> bool:
        return self._call(Op.KV_RELEASE, pair, [], margin_s=_RELEASE_S).found

    def close(self) -> None:
        self._channel.close()
