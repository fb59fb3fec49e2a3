"""What the attack-surface tests share: this machine's cluster-network address, the secrets and
ready line of the launched configurations, the probe of every listening socket of a deployment
(attack_probes), and serving one request checked against transformers' greedy output."""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from epdserve import Client
from epdserve.model.reference import ReferenceGenerator
from tests.security.attack_probes import listening, tree, usable


KEY, TOKEN = "attack-test-api-key-7f3a", "attack-test-cluster-token-91c2"
READY = re.compile(r"^epdserve ready: grpc://(?P<grpc>\S+) mode=\S+ .*?(?: http=(?P<http>\S+))? "
                   r"internal=grpc://(?P<internal>\S+)$")
PROMPT, MAX_TOKENS = "Tell me a story about", 6


def cluster_ip() -> str | None:
    """This machine's first non-loopback IPv4 address (where a cluster network would be)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


IP = cluster_ip()
needs_ip = pytest.mark.skipif(IP is None, reason="no non-loopback interface to bind beyond loopback")


def clean_env(**secrets: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPDSERVE_")}
    return {**env, **secrets}


def assert_no_usable_listener(pid: int, tls_ca: str | None = None) -> list:
    """Every socket of the process tree under `pid`: loopback, or nothing works without a credential."""
    sockets = listening(tree(pid))
    assert sockets, "no listener found"
    assert not [s for s in sockets if s.ip in ("0.0.0.0", "::")], f"bound to every interface: {sockets}"
    exposed = [s for s in sockets if not s.loopback]
    with ThreadPoolExecutor(max(1, len(exposed))) as pool:  # each probe waits on timeouts: all at once
        tried = list(pool.map(lambda s: usable(s.ip, s.port, tls_ca), exposed))
    open_ = {f"{s.name} {s.ip}:{s.port}": got for s, got in zip(exposed, tried) if got}
    assert not open_, f"usable without a credential: {open_}"
    return exposed


def reference_tokens(model_dir) -> list[int]:
    return ReferenceGenerator(model_dir).generate(PROMPT, max_tokens=MAX_TOKENS)


def serve_one(address: str, reference, **tls) -> None:
    with Client(address, api_key=KEY, timeout=180, **tls) as c:
        out = c.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert list(out.token_ids) == list(reference)
