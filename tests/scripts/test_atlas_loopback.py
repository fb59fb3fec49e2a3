"""The Atlas scripts' configuration, run for real on loopback (DEVICE=cpu, NODE_IP=HEAD_IP=
127.0.0.1): `atlas_node.sh head` and `atlas_node.sh instances EPD 0` with their secrets in a 0600
env file, the MM Store a password-protected Redis started here. A request with the API key is
served (its image's features land in the Redis), one without is refused, every process listens
on loopback only, and no secret (cluster token, API key, Redis password) is in any process's argv."""

import shutil
import time

import grpc
import psutil
import pytest
import redis

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.net import free_port
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.scheduler.harness import PH, image
from tests.scripts.atlas_harness import Node, loopback, script_env

pytestmark = pytest.mark.slow

TOKEN, KEY, REDIS_PW = "atlas-token-5c9e07d2a1", "atlas-key-81b4fe63c0", "atlas-redis-pw-2d7a94"


@pytest.fixture(scope="module")
def cluster(qwen2_vl_tiny, tmp_path_factory):
    home = tmp_path_factory.mktemp("atlas_home")
    env_file = home / "env"
    env_file.write_text(f"EPDSERVE_CLUSTER_TOKEN={TOKEN}\nEPDSERVE_API_KEY={KEY}\nEPDSERVE_MM_STORE_PASSWORD={REDIS_PW}\n")
    env_file.chmod(0o600)
    with LocalRedisServer(password=REDIS_PW, binary=shutil.which("redis-server")) as store:
        sched_port, reg_port = free_port(), free_port()
        env = script_env(qwen2_vl_tiny, sched_port, reg_port, store.address_url, EPDSERVE_ENV_FILE=str(env_file))
        nodes = [Node(["head"], env)]
        try:
            nodes[0].wait_for("epdserve scheduler ready")
            nodes.append(Node(["instances", "EPD", "0"], env))
            nodes[1].wait_for("epdserve instance ready")
            client = Client(f"127.0.0.1:{sched_port}", timeout=120, api_key=KEY)
            deadline = time.monotonic() + 60
            while not client.server_info().instances:
                assert time.monotonic() < deadline, "the instance never registered"
                time.sleep(0.5)
            yield {"client": client, "nodes": nodes, "store": store, "ports": (sched_port, reg_port)}
            client.close()
            started = [p for node in nodes for p in node.processes()]
            for node in reversed(nodes):
                node.stop()
            _, alive = psutil.wait_procs(started, timeout=30)
            for p in alive:
                p.kill()
            assert not alive, f"left running after SIGTERM to atlas_node.sh: {[p.pid for p in alive]}"
        finally:
            for node in reversed(nodes):
                node.stop()


def test_a_request_with_the_api_key_is_served_and_one_without_is_refused(cluster):
    result = cluster["client"].generate(f"Describe {PH}", images=[image(0)], max_tokens=4)
    assert result.usage.output_tokens == 4 and result.usage.vision_tokens > 0
    assert redis.Redis(host=cluster["store"].host, port=cluster["store"].port, password=REDIS_PW).dbsize() > 0
    stranger = Client(f"127.0.0.1:{cluster['ports'][0]}", timeout=10, api_key="wrong-key")
    with pytest.raises(EPDServeError) as e:
        stranger.generate("hello", max_tokens=2)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    stranger.close()


def test_every_listener_is_on_loopback_and_the_registry_on_its_own_port(cluster):
    listening = {}
    for node in cluster["nodes"]:
        for p in node.processes():
            for c in p.net_connections("inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening[c.laddr] = p.cmdline()
    assert listening and all(loopback(addr.ip) for addr in listening), listening
    assert {addr.port for addr in listening} >= set(cluster["ports"])


def test_no_secret_in_any_argv(cluster):
    argvs = [" ".join(p.cmdline()) for node in cluster["nodes"] for p in node.processes()]
    assert any(" scheduler " in a for a in argvs) and any(" instance " in a for a in argvs)
    assert "--insecure" not in " ".join(argvs)
    for secret in (TOKEN, KEY, REDIS_PW):
        assert not any(secret in a for a in argvs), secret
    assert REDIS_PW not in " ".join(psutil.Process(cluster["store"]._proc.pid).cmdline())
