"""INSECURE=1, the Atlas scripts' lab switch, run for real on loopback (DEVICE=cpu): no env file,
`--insecure` handed to the scheduler and the instance, a warning from the script on every start,
and requests served without a key."""

import shutil
import time

import pytest

from epdserve import Client
from epdserve.net import free_port
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.scripts.atlas_harness import Node, script_env

pytestmark = pytest.mark.slow

WARNING = "atlas_node.sh: WARNING: INSECURE=1"


def test_insecure_runs_without_env_file_and_warns(qwen2_vl_tiny, tmp_path):
    with LocalRedisServer(binary=shutil.which("redis-server")) as store:
        sched_port = free_port()
        env = script_env(qwen2_vl_tiny, sched_port, free_port(), store.address_url, INSECURE="1",
                         EPDSERVE_ENV_FILE=str(tmp_path / "no-such-env"))
        head = Node(["head"], env)
        nodes = [head]
        try:
            head.wait_for("epdserve scheduler ready")
            nodes.append(Node(["instances", "EPD", "0"], env))
            nodes[1].wait_for("epdserve instance ready")
            for node in nodes:
                assert any(WARNING in line for line in node.lines), "".join(node.lines)
                epdserve = [a for a in (p.cmdline() for p in node.processes()) if {"scheduler", "instance"} & set(a)]
                assert epdserve and all("--insecure" in argv for argv in epdserve)
            with Client(f"127.0.0.1:{sched_port}", timeout=120) as client:  # no API key is configured, so none is checked
                deadline = time.monotonic() + 60
                while not client.server_info().instances:
                    assert time.monotonic() < deadline, "the instance never registered"
                    time.sleep(0.5)
                assert client.generate("hello", max_tokens=3).usage.output_tokens == 3
        finally:
            for node in reversed(nodes):
                node.stop()
