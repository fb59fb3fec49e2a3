"""KV pairing from the attacker's side, between real instances (a P and a D `InstanceHost`, a
cluster token; then mutual TLS too): the pair's store is P's own gRPC port — no listener opens for
it, and every socket the pair opens is on the instances' host (loopback); the `KvStore` RPC
refuses a caller without the token and an attacker's write never reaches the store; requests go
P → D bit-exact (greedy tokens equal transformers' generate)."""
from __future__ import annotations

import ipaddress

import grpc
import psutil
import pytest

from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc
from epdserve.security import Secret
from epdserve.security.interceptors import cluster_metadata, metadata_interceptors
from epdserve.security.options import InstanceSecurity
from epdserve.security.tls import channel_credentials
from epdserve.transfer.kv.pair_names import pair_name
from tests.instance.harness import Prepared, run_disaggregated, status
from tests.security.certs import self_signed

TOKEN = "kv-pairing-cluster-token"
GREEDY = common_pb2.SamplingParams(max_tokens=6, ignore_eos=True)
Op = instance_pb2.KvStoreRequest


def _ip(text: str) -> str:
    """An address as IPv4 when it is one mapped into IPv6 (gRPC binds 127.0.0.1 as ::ffff:127.0.0.1)."""
    ip = ipaddress.ip_address(text)
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _listening() -> set[tuple[str, int]]:
    """(address, port) of every socket this process listens on (the instances run in it)."""
    return {(_ip(c.laddr.ip), c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


class Deployment:
    """A P and a D instance in this process; `stub(host)` calls one as the scheduler does."""

    def __init__(self, model, security: InstanceSecurity, creds: grpc.ChannelCredentials | None = None):
        self.creds = creds
        self.hosts = []
        try:
            for roles in ("P", "D"):
                self.hosts.append(InstanceHost(InstanceConfig(roles=roles, model=str(model), kv_cache_bytes=4 << 20),
                                               security=security).start())
        except BaseException:
            self.close()
            raise
        self.p, self.d = self.hosts
        self._channels = []

    def channel(self, host: InstanceHost, creds: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        address = f"127.0.0.1:{host.port}"
        ch = grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)
        self._channels.append(ch)
        return ch

    def stub(self, host: InstanceHost, token: str | None = TOKEN) -> instance_pb2_grpc.InstanceStub:
        pairs = cluster_metadata(Secret(token)) if token else []
        return instance_pb2_grpc.InstanceStub(grpc.intercept_channel(self.channel(host, self.creds),
                                                                     *metadata_interceptors(pairs)))

    def generate(self, ref, rid: str, prompt: str) -> list[int]:
        p, d = self.stub(self.p), self.stub(self.d)
        req = Prepared(ref.processor, status(p).media_namespace, prompt, [])
        tokens, _, last, _ = run_disaggregated(p, p, d, rid, req, GREEDY, status(p))
        assert last is not None and last.finished
        return tokens

    def close(self) -> None:
        for ch in getattr(self, "_channels", []):
            ch.close()
        for h in self.hosts:
            h.stop()


@pytest.fixture(scope="module")
def ref(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny)


@pytest.fixture(autouse=True)
def no_env_secrets(monkeypatch):
    monkeypatch.delenv("EPDSERVE_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)


@pytest.fixture
def token_deployment(qwen2_vl_tiny):
    dep = Deployment(qwen2_vl_tiny, InstanceSecurity(Secret(TOKEN)))
    yield dep
    dep.close()


def test_the_pair_opens_no_store_listener_and_only_loopback_sockets(token_deployment, ref):
    dep = token_deployment
    st = status(dep.stub(dep.p))
    assert (st.kv_endpoint.host, st.kv_endpoint.port) == ("127.0.0.1", dep.p.port)  # the store: P's own port
    assert not status(dep.stub(dep.d)).HasField("kv_endpoint")
    before = _listening()
    assert {("127.0.0.1", dep.p.port), ("127.0.0.1", dep.d.port)} <= before
    prompt = "Pairs over the prefill port"
    assert dep.generate(ref, "kv-1", prompt) == ref.generate(prompt, [], max_tokens=GREEDY.max_tokens)
    opened = _listening() - before
    # building the pair opened gloo's listener on each side and nothing else (no store), on loopback
    assert len(opened) == 2 and {ip for ip, _ in opened} == {"127.0.0.1"}, opened
    every = _listening()
    assert not {ip for ip, _ in every} & {"0.0.0.0", "::"}, every
    assert {ip for ip, _ in every} == {"127.0.0.1"}, every


def test_the_store_rpc_refuses_callers_without_the_token(token_deployment, ref):
    dep = token_deployment
    assert dep.generate(ref, "kv-2", "A first request builds the pair")
    live = pair_name(dep.p.instance_id, dep.d.instance_id, 0)
    store = dep.p.pair_store
    keys_before = store.num_keys(live)
    assert keys_before >= 2  # gloo's addresses of both sides
    attacks = [Op(op=Op.KV_SET, pair_name=live, keys=["batch-header/1"], value=b'{"seq": 1}'),
               Op(op=Op.KV_SET, pair_name="evil>pair/g0", keys=["0/0"], value=b"attacker:4444"),
               Op(op=Op.KV_COMPARE_SET, pair_name=live, keys=["0/0"], expected=b"", value=b"x"),
               Op(op=Op.KV_GET, pair_name=live, keys=["0/0"]),
               Op(op=Op.KV_NUM_KEYS, pair_name=live),
               Op(op=Op.KV_RELEASE, pair_name=live)]
    for token in (None, "not-the-token"):
        stub = dep.stub(dep.p, token=token)
        for req in attacks:
            with pytest.raises(grpc.RpcError) as e:
                stub.KvStore(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, Op.Op.Name(req.op)
    assert store.num_keys(live) == keys_before and not store.check(live, ["batch-header/1"])
    assert store.num_keys("evil>pair/g0") == 0
    # with the token it is a store (operators and instances hold the token)
    holder = dep.stub(dep.p)
    assert holder.KvStore(Op(op=Op.KV_NUM_KEYS, pair_name=live), timeout=10).number == keys_before
    with pytest.raises(grpc.RpcError) as e:  # an instance that does not prefill keeps no store
        dep.stub(dep.d).KvStore(Op(op=Op.KV_NUM_KEYS, pair_name=live), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    prompt = "The pair still carries KV"
    assert dep.generate(ref, "kv-3", prompt) == ref.generate(prompt, [], max_tokens=GREEDY.max_tokens)


def test_pair_over_mutual_tls(qwen2_vl_tiny, ref, tmp_path):
    cert, key = self_signed(tmp_path)
    dep = Deployment(qwen2_vl_tiny, InstanceSecurity(Secret(TOKEN), tls_cert=cert, tls_key=key, tls_ca=cert),
                     creds=channel_credentials(cert, cert, key))
    try:
        prompt = "KV pairing under mutual TLS"
        assert dep.generate(ref, "tls-1", prompt) == ref.generate(prompt, [], max_tokens=GREEDY.max_tokens)
        for creds in (None, channel_credentials(cert)):  # plaintext; TLS without a client certificate
            stub = instance_pb2_grpc.InstanceStub(grpc.intercept_channel(
                dep.channel(dep.p, creds), *metadata_interceptors(cluster_metadata(Secret(TOKEN)))))
            with pytest.raises(grpc.RpcError) as e:
                stub.KvStore(Op(op=Op.KV_NUM_KEYS, pair_name="x"), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert {ip for ip, _ in _listening()} == {"127.0.0.1"}
    finally:
        dep.close()
