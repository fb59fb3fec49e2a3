"""Issue 24 from the attacker's side: each documented configuration launched for real, and every
socket every process of it listens on (psutil) either loopback-only or refusing an
unauthenticated caller in every protocol a deployment speaks (attack_probes.usable).

Configurations: the default (loopback); the API key only, on the cluster network (this
machine's first non-loopback address: the issue's hijack case); API key + cluster token; mutual
TLS between scheduler and instances; the Atlas scripts' configuration (`atlas_node.sh`,
DEVICE=cpu) on that address. P-D deployments serve a request first, so that the KV pair's
sockets exist when they are counted. On the API-key deployment: the hijack (a fake instance
registering), a TCPStore write, every SSRF spelling of loopback, a redirect to an internal
host and the metadata address, integers out of range, and a pixel bomb. A port beyond loopback
without its credential refuses to start, with the fix; --insecure starts with a warning.
"""
from __future__ import annotations

import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from PIL import Image

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.model.reference import ReferenceGenerator
from epdserve.net import free_port
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.entrypoints.launch_harness import launched
from tests.scheduler.harness import PH, image
from tests.scripts.atlas_harness import Node, script_env
from tests.security.attack_probes import listening, tree, usable
from tests.security.certs import self_signed

pytestmark = pytest.mark.slow

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


def _env(**secrets: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPDSERVE_")}
    return {**env, **secrets}


def _assert_no_usable_listener(pid: int, tls_ca: str | None = None) -> list:
    """Every socket of the process tree under `pid`: loopback, or nothing works without a credential."""
    sockets = listening(tree(pid))
    assert sockets, "no listener found"
    assert not [s for s in sockets if s.ip in ("0.0.0.0", "::")], f"bound to every interface: {sockets}"
    exposed = [s for s in sockets if not s.loopback]
    open_ = {f"{s.name} {s.ip}:{s.port}": got for s in exposed if (got := usable(s.ip, s.port, tls_ca))}
    assert not open_, f"usable without a credential: {open_}"
    return exposed


@pytest.fixture(scope="module")
def reference(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny).generate(PROMPT, max_tokens=MAX_TOKENS)


def _serve_one(address: str, reference, **tls) -> None:
    with Client(address, api_key=KEY, timeout=180, **tls) as c:
        out = c.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert list(out.token_ids) == list(reference)


# ------------------------------------------------------------------ configurations, each probed
def test_default_configuration_listens_on_loopback_only(qwen2_vl_tiny, reference):
    args = ["--mode", "P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--http-port", "0"]
    with launched(args, _env(EPDSERVE_API_KEY=KEY), READY, secrets=(KEY,)) as (found, _):
        _serve_one(found["grpc"], reference)  # the KV pair exists from here on
        sockets = listening(tree(int(found["launcher_pid"])))
        assert sockets and not [s for s in sockets if not s.loopback], [s for s in sockets if not s.loopback]


@needs_ip
def test_api_key_only_on_the_cluster_network(qwen2_vl_tiny, reference, tmp_path):
    """The issue's case 1: only EPDSERVE_API_KEY set, bound to the cluster network."""
    with _RedirectSites() as sites:
        args = ["--mode", "P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--host", IP,
                "--http-port", "0", "--served-model-name", "m",
                "--scheduler-args", "--allow-remote-images --allowed-media-domains localhost"]
        with launched(args, _env(EPDSERVE_API_KEY=KEY), READY, secrets=(KEY,)) as (found, output):
            _serve_one(found["grpc"], reference)
            exposed = _assert_no_usable_listener(int(found["launcher_pid"]))
            assert any(s.port == int(found["internal"].rsplit(":", 1)[1]) for s in exposed)
            _hijack_is_refused(found, reference)
            _ssrf_is_refused(found["http"], sites, found["internal"])
            _overflow_is_refused(found)
            _pixel_bomb_is_refused(found)
            assert not any("\x00" in line or "Traceback" in line for line in output)


@needs_ip
def test_api_key_and_cluster_token_on_the_cluster_network(qwen2_vl_tiny, reference):
    args = ["--mode", "P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--host", IP]
    with launched(args, _env(EPDSERVE_API_KEY=KEY, EPDSERVE_CLUSTER_TOKEN=TOKEN), READY,
                  secrets=(KEY, TOKEN)) as (found, _):
        _serve_one(found["grpc"], reference)
        _assert_no_usable_listener(int(found["launcher_pid"]))


@needs_ip
def test_mutual_tls_on_the_cluster_network(qwen2_vl_tiny, reference, tmp_path):
    cert, key = self_signed(tmp_path, ips=(IP,))
    args = ["--mode", "P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--host", IP,
            "--internal-tls-cert", cert, "--internal-tls-key", key, "--internal-tls-ca", cert]
    with launched(args, _env(EPDSERVE_API_KEY=KEY), READY, secrets=(KEY,)) as (found, _):
        _serve_one(found["grpc"], reference)
        _assert_no_usable_listener(int(found["launcher_pid"]), tls_ca=cert)


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
            _serve_one(f"{IP}:{sched_port}", reference)
            for node in nodes:
                exposed = _assert_no_usable_listener(node.proc.pid)
                assert all(s.address == IP for s in exposed), exposed
        finally:
            for node in reversed(nodes):
                node.stop()


# ------------------------------------------------------------------ refusals at start
def _cli(*argv: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


@needs_ip
@pytest.mark.parametrize("argv, env, fix", [
    (["scheduler", "--host", IP], {}, "EPDSERVE_API_KEY"),
    (["scheduler", "--internal-host", IP], {"EPDSERVE_API_KEY": KEY}, "EPDSERVE_CLUSTER_TOKEN"),
    (["scheduler", "--http-port", "0", "--http-host", IP], {}, "EPDSERVE_API_KEY"),
    (["scheduler", "--metrics-port", "0", "--host", "127.0.0.1", "--http-host", IP], {}, "EPDSERVE_API_KEY"),
    (["instance", "--roles", "EPD", "--host", IP], {}, "EPDSERVE_CLUSTER_TOKEN"),
])
def test_a_port_beyond_loopback_without_its_credential_refuses_to_start(qwen2_vl_tiny, argv, env, fix):
    out = _cli(*argv[:1], "--model", str(qwen2_vl_tiny), *argv[1:], env=_env(**env))
    assert out.returncode == 2, out.stderr[-2000:]
    refusal = [line for line in out.stderr.splitlines() if "refusing to serve" in line]
    assert len(refusal) == 1 and fix in refusal[0] and "--insecure" in refusal[0], out.stderr[-2000:]


@needs_ip
def test_insecure_starts_with_a_warning(qwen2_vl_tiny, tmp_path):
    addr = tmp_path / "addr"
    proc = subprocess.Popen([sys.executable, "-m", "epdserve.entrypoints.cli", "scheduler", "--model",
                             str(qwen2_vl_tiny), "--host", IP, "--insecure", "--address-file", str(addr)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not addr.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert "WARNING" in output and "insecure" in output


# ------------------------------------------------------------------ attacks on the API-key deployment
def _hijack_is_refused(found: dict, reference) -> None:
    fake = common_pb2.InstanceStatus(instance_id="EPD-hijack", roles="EPD", address="127.0.0.1:9", model="x")
    for where, expect in ((found["internal"], grpc.StatusCode.UNAUTHENTICATED),
                          (found["grpc"], grpc.StatusCode.UNIMPLEMENTED)):  # never served on the public port
        with grpc.insecure_channel(where) as ch:
            with pytest.raises(grpc.RpcError) as e:
                instance_pb2_grpc.RegistryStub(ch).Register(instance_pb2.RegisterRequest(instance=fake), timeout=5)
        assert e.value.code() == expect, (where, e.value)
    with Client(found["grpc"], api_key=KEY, timeout=180) as c:
        roster = c.server_info().instances
        assert len(roster) == 2 and "EPD" not in {i.roles for i in roster}  # the P-D pair, no coupled stranger
        for _ in range(3):
            assert list(c.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids) == list(reference)


class _RedirectSites:
    """Two loopback web servers: `target` counts what reaches it; `redirector` answers every GET
    with a redirect to a URL set per test (reached as localhost: the allow-listed name)."""

    def __init__(self):
        self.hits = {"target": 0, "redirector": 0}
        self.location = ""
        sites = self

        class Target(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                sites.hits["target"] += 1
                self.send_response(200)
                self.end_headers()
                self.wfile.write(image(1))

            def log_message(self, *a):
                pass

        class Redirector(Target):
            def do_GET(self):
                sites.hits["redirector"] += 1
                self.send_response(302)
                self.send_header("Location", sites.location)
                self.end_headers()

        self.servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (Target, Redirector)]
        self.target_port, self.redirector_port = (s.server_address[1] for s in self.servers)

    def __enter__(self):
        for s in self.servers:
            threading.Thread(target=s.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        for s in self.servers:
            s.shutdown()
            s.server_close()


def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())  # every error body is JSON


def _chat_with_image(base: str, url: str) -> tuple[int, dict]:
    return _post(base, "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]})


def _ssrf_is_refused(base: str, sites: _RedirectSites, internal: str) -> None:
    p = sites.target_port
    urls = [f"http://{host}:{p}/a.jpg" for host in
            ("127.0.0.1", "[::ffff:127.0.0.1]", "2130706433", "0x7f000001", "127.1", "0177.0.0.1", "[::1]")]
    urls += ["http://169.254.169.254/latest/meta-data/", f"http://{internal}/", f"http://{IP}:{p}/a.jpg"]
    texts = set()
    for url in urls:
        status, body = _chat_with_image(base, url)
        assert status == 400, (url, body)
        texts.add(body["error"]["message"].rsplit(": ", 1)[-1])
    sites.location = f"http://127.0.0.1:{p}/a.jpg"  # allow-listed name, redirect to an internal address
    status, body = _chat_with_image(base, f"http://localhost:{sites.redirector_port}/r.jpg")
    assert status == 400 and sites.hits["redirector"] == 1, body
    texts.add(body["error"]["message"].rsplit(": ", 1)[-1])
    assert sites.hits["target"] == 0, "an internal address was fetched"
    assert texts == {"cannot fetch the image"}, texts  # one text: no port scanner


def _overflow_is_refused(found: dict) -> None:
    base = found["http"]
    for field, value in (("max_tokens", 2**31), ("seed", 2**63), ("top_k", 2**32), ("temperature", -1)):
        status, body = _post(base, "/v1/completions", {"model": "m", "prompt": "hi", field: value})
        assert status == 400 and field in json.dumps(body["error"]), (field, body)
    status, body = _post(base, "/v1/completions", {"model": "m", "prompt": [2**31 + 5], "max_tokens": 2})
    assert status == 400 and "error" in body
    with Client(found["grpc"], api_key=KEY, timeout=30) as c:
        for prompt, kw in (("hi", {"max_tokens": -1}), ("hi", {"top_k": -5}), ([2**31 - 1], {})):
            with pytest.raises(EPDServeError) as e:
                c.generate(prompt, **kw)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, (prompt, kw)


def _pixel_bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    return buf.getvalue()


def _pixel_bomb_is_refused(found: dict) -> None:
    import base64

    bomb = _pixel_bomb()
    assert len(bomb) < 200_000  # 400 M pixels declared in a small file
    status, body = _chat_with_image(found["http"], "data:image/png;base64," + base64.b64encode(bomb).decode())
    assert status == 400 and "pixels" in body["error"]["message"], body
    with Client(found["grpc"], api_key=KEY, timeout=30) as c:
        with pytest.raises(EPDServeError) as e:
            c.generate(f"what is {PH}", images=[bomb], max_tokens=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
