"""Issue 24 from the attacker's side, the other documented configurations on the cluster network
(this machine's first non-loopback address): API key + cluster token, mutual TLS between
scheduler and instances, and the Atlas scripts' configuration (atlas_node.sh, DEVICE=cpu). Each is
launched for real and serves a request exactly; every socket beyond loopback of every process
refuses an unauthenticated caller in every protocol a deployment speaks (attack_probes.usable)."""
from __future__ import annotations

import shutil
import time

import pytest

from epdserve import Client
from epdserve.net import free_port
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.entrypoints.launch_harness import launched
from tests.scripts.atlas_harness import Node, script_env
from tests.security.certs import self_signed
from tests.security.attack_harness import (IP, KEY, READY, TOKEN, assert_no_usable_listener, clean_env, needs_ip,
                                           reference_tokens, serve_one)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(qwen2_vl_tiny):
    return reference_tokens(qwen2_vl_tiny)


@needs_ip
def test_api_key_and_cluster_token_on_the_cluster_network(qwen2_vl_tiny, reference):
    args = ["--mode", "monolithic", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--host", IP]
    with launched(args, clean_env(EPDSERVE_API_KEY=KEY, EPDSERVE_CLUSTER_TOKEN=TOKEN), READY,
                  secrets=(KEY, TOKEN)) as (found, _):
        serve_one(found["grpc"], reference)
        assert_no_usable_listener(int(found["launcher_pid"]))


@needs_ip
def test_mutual_tls_on_the_cluster_network(qwen2_vl_tiny, reference, tmp_path):
    cert, key = self_signed(tmp_path, ips=(IP,))
    args = ["--mode", "monolithic", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--host", IP,
            "--internal-tls-cert", cert, "--internal-tls-key", key, "--internal-tls-ca", cert]
    with launched(args, clean_env(EPDSERVE_API_KEY=KEY), READY, secrets=(KEY,)) as (found, _):
        serve_one(found["grpc"], reference)
        assert_no_usable_listener(int(found["launcher_pid"]), tls_ca=cert)


@needs_ip
def test_atlas_scripts_configuration_on_the_cluster_network(qwen2_vl_tiny, reference, tmp_path):
    env_file = tmp_path / "env"
    password = "attack-test-redis-pw-3e1"
    env_file.write_text(f"EPDSERVE_CLUSTER_TOKEN={TOKEN}\nEPDSERVE_API_KEY={KEY}\nEPDSERVE_MM_STORE_PASSWORD={password}\n")
    env_file.chmod(0o600)
    with LocalRedisServer(password=password, binary=shutil.which("redis-server")) as store:
        sched_port, reg_port = free_port(), free_port()
        env = script_env(qwen2_vl_tiny, sched_port, reg_port, store.address_url, EPDSERVE_ENV_FILE=str(env_file))
        env.update(NODE_IP=IP, HEAD_IP=IP)  # the scripts' configuration, on the cluster network
        env.pop("NIC")  # the script finds the interface that holds NODE_IP
        nodes = [Node(["head"], env)]
        try:
            nodes[0].wait_for("epdserve scheduler ready")
            nodes.append(Node(["instances", "EPD", "0"], env))
            nodes[1].wait_for("epdserve instance ready")
            deadline = time.monotonic() + 60
            with Client(f"{IP}:{sched_port}", api_key=KEY, timeout=120) as c:
                while not c.server_info().instances:
                    assert time.monotonic() < deadline, "the instance never registered"
                    time.sleep(0.5)
            serve_one(f"{IP}:{sched_port}", reference)
            for node in nodes:
                exposed = assert_no_usable_listener(node.proc.pid)
                assert all(s.address == IP for s in exposed), exposed
        finally:
            for node in reversed(nodes):
                node.stop()
