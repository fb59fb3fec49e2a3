"""Issue 24 from the attacker's side, the deployments the issue attacked: the default (loopback)
and the API key only on the cluster network (this machine's first non-loopback address). Each is
launched for real; every socket every process of it listens on (psutil) is loopback-only or
refuses an unauthenticated caller in every protocol a deployment speaks (attack_probes.usable).
P-D, with a request served first, so that the KV pair's sockets exist when they are counted. On
the API-key deployment: the hijack (a fake instance registering), every SSRF spelling of
loopback, a redirect to an internal host and the metadata address, integers out of range, and a
pixel bomb. The other documented configurations: test_attack_configs.py; refusals at start:
test_attack_startup.py.
"""
from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from PIL import Image

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc
from tests.entrypoints.launch_harness import launched
from tests.scheduler.harness import PH, image
from tests.security.attack_probes import listening, tree
from tests.security.attack_harness import (IP, KEY, MAX_TOKENS, PROMPT, READY, assert_no_usable_listener, clean_env,
                                           needs_ip, reference_tokens, serve_one)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(qwen2_vl_tiny):
    return reference_tokens(qwen2_vl_tiny)


# ------------------------------------------------------------------ configurations, each probed
def test_default_configuration_listens_on_loopback_only(qwen2_vl_tiny, reference):
    args = ["--mode", "P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--http-port", "0"]
    with launched(args, clean_env(EPDSERVE_API_KEY=KEY), READY, secrets=(KEY,)) as (found, _):
        serve_one(found["grpc"], reference)  # the KV pair exists from here on
        sockets = listening(tree(int(found["launcher_pid"])))
        assert sockets and not [s for s in sockets if not s.loopback], [s for s in sockets if not s.loopback]


@needs_ip
def test_api_key_only_on_the_cluster_network(qwen2_vl_tiny, reference, tmp_path):
    """The issue's case 1: only EPDSERVE_API_KEY set, bound to the cluster network."""
    with _RedirectSites() as sites:
        args = ["--mode", "P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--host", IP,
                "--http-port", "0", "--served-model-name", "m",
                "--scheduler-args", "--allow-remote-images --allowed-media-domains localhost"]
        with launched(args, clean_env(EPDSERVE_API_KEY=KEY), READY, secrets=(KEY,)) as (found, output):
            serve_one(found["grpc"], reference)
            exposed = assert_no_usable_listener(int(found["launcher_pid"]))
            assert any(s.port == int(found["internal"].rsplit(":", 1)[1]) for s in exposed)
            _hijack_is_refused(found, reference)
            _ssrf_is_refused(found["http"], sites, found["internal"])
            _overflow_is_refused(found)
            _pixel_bomb_is_refused(found)
            assert not any("\x00" in line or "Traceback" in line for line in output)


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
    bomb = _pixel_bomb()
    assert len(bomb) < 200_000  # 400 M pixels declared in a small file
    status, body = _chat_with_image(found["http"], "data:image/png;base64," + base64.b64encode(bomb).decode())
    assert status == 400 and "pixels" in body["error"]["message"], body
    with Client(found["grpc"], api_key=KEY, timeout=30) as c:
        with pytest.raises(EPDServeError) as e:
            c.generate(f"what is {PH}", images=[bomb], max_tokens=2)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
