"""What an attacker on the network tries against every socket a deployment listens on.

`listening(processes)`: every (process, ip, port) in LISTEN state, read with psutil.
`usable(ip, port)`: what an unauthenticated caller can do there — each protocol a deployment
speaks, tried without any credential: gRPC (EPDServe.GetServerInfo, Registry.Register,
Instance.GetLoad, a write to the KV pair store Instance.KvStore), HTTP (/v1/models, /metrics),
Redis (PING) and torch's TCPStore (a key written: what pairs used before the store moved to P's
gRPC port). Returns the list of what worked (empty: the socket refuses an unauthenticated caller
in every protocol we know).
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta

import grpc
import psutil

from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc, serve_pb2, serve_pb2_grpc


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str  # the process's command line, shortened
    ip: str
    port: int

    @property
    def address(self) -> str:
        """The address bound, an IPv4-mapped one as its IPv4 (gRPC binds ::ffff:a.b.c.d)."""
        addr = ipaddress.ip_address(self.ip.split("%")[0])
        return str(getattr(addr, "ipv4_mapped", None) or addr)

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def listening(processes: list[psutil.Process]) -> list[Listener]:
    found = []
    for p in processes:
        try:
            conns = p.net_connections(kind="inet")
            name = " ".join(p.cmdline()[:6])[:160]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [Listener(p.pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _dial(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _grpc(ip: str, port: int) -> list[str]:
    worked = []
    calls = [
        ("EPDServe.GetServerInfo", lambda ch: serve_pb2_grpc.EPDServeStub(ch).GetServerInfo(
            serve_pb2.GetServerInfoRequest(), timeout=3)),
        ("Registry.Register", lambda ch: instance_pb2_grpc.RegistryStub(ch).Register(instance_pb2.RegisterRequest(
            instance=common_pb2.InstanceStatus(instance_id="EPD-attacker", roles="EPD", address="127.0.0.1:9")),
            timeout=3)),
        ("Instance.GetLoad", lambda ch: instance_pb2_grpc.InstanceStub(ch).GetLoad(instance_pb2.GetLoadRequest(),
                                                                                   timeout=3)),
        ("Instance.KvStore write", lambda ch: instance_pb2_grpc.InstanceStub(ch).KvStore(instance_pb2.KvStoreRequest(
            op=instance_pb2.KvStoreRequest.KV_SET, pair_name="epdserve-attack", keys=["k"], value=b"x"), timeout=3)),
    ]
    with grpc.insecure_channel(_dial(ip, port)) as ch:
        for what, call in calls:
            try:
                call(ch)
                worked.append(f"gRPC {what}")
            except grpc.RpcError:
                pass  # UNAUTHENTICATED, UNIMPLEMENTED (not served here), UNAVAILABLE (TLS / not gRPC)
    return worked


def _http(ip: str, port: int) -> list[str]:
    worked = []
    for path in ("/v1/models", "/metrics"):
        conn = http.client.HTTPConnection(ip, port, timeout=3)
        try:
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                worked.append(f"HTTP GET {path}")
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
    return worked


def _redis(ip: str, port: int) -> list[str]:
    try:
        with socket.create_connection((ip, port), timeout=3) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return []
    return ["Redis PING"] if reply.startswith(b"+PONG") else []


def _tcpstore(ip: str, port: int) -> list[str]:
    """A key written as torch's TCPStore client would; in a daemon thread with our own deadline,
    since the client can wait past its timeout on a socket that accepts and never answers."""
    import threading

    from torch.distributed import TCPStore

    wrote = []

    def attempt():
        try:
            TCPStore(ip, port, None, False, timeout=timedelta(seconds=3)).set("epdserve-attack", "x")
            wrote.append("TCPStore write")
        except Exception:  # refused, timed out, not a store
            pass

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(8)
    return wrote


def _grpc_tls(ip: str, port: int, ca: str) -> list[str]:
    """gRPC over TLS trusting `ca`, with no client certificate and no credential."""
    creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
    with grpc.secure_channel(_dial(ip, port), creds) as ch:
        try:
            serve_pb2_grpc.EPDServeStub(ch).GetServerInfo(serve_pb2.GetServerInfoRequest(), timeout=3)
            return ["gRPC over TLS EPDServe.GetServerInfo"]
        except grpc.RpcError:
            pass
        try:
            instance_pb2_grpc.InstanceStub(ch).GetLoad(instance_pb2.GetLoadRequest(), timeout=3)
            return ["gRPC over TLS Instance.GetLoad"]
        except grpc.RpcError:
            return []


def usable(ip: str, port: int, tls_ca: str | None = None) -> list[str]:
    """What an unauthenticated caller got from ip:port (empty: nothing); `tls_ca`: also try TLS,
    trusting it (a deployment's own CA: the attacker has no client certificate)."""
    worked = _grpc(ip, port) + _http(ip, port) + _redis(ip, port) + _tcpstore(ip, port)
    return worked + (_grpc_tls(ip, port, tls_ca) if tls_ca else [])
