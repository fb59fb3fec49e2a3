"""`epdserve launch --tls-cert/--tls-key` as real processes, with an API key from the environment
and a self-signed certificate made here: the launcher's readiness probe speaks TLS with the key,
so the deployment becomes ready; it serves gRPC and HTTPS (the ready line says https and
tls=1), both refusing plaintext; `--scheduler-args "--allow-remote-images --allowed-media-domains
127.0.0.1"` (a value that starts with --) reaches the scheduler (a loopback image server is fetched
only because it is allow-listed); the HTTP model id is --model as given; the private MM Store's
password file named on the ready line holds the password the store asks for."""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import ssl
import stat
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis

from epdserve.client import Client, EPDServeError
from tests.entrypoints.launch_harness import launched
from tests.instance.harness import image
from tests.security.certs import self_signed

pytestmark = pytest.mark.slow

READY = re.compile(r"^epdserve ready: grpc://(?P<grpc>\S+) mode=monolithic instances=\S+ mm_store=(?P<mm>\S+) "
                   r"mm_store_password_file=(?P<pwfile>\S+) cluster_token_file=(?P<tokenfile>\S+) "
                   r"media_key_secret_file=(?P<secretfile>\S+) tls=1 "
                   r"http=(?P<http>https://\S+) internal=grpc://\S+$")
KEY = "launch-tls-api-key-0123"


@contextlib.contextmanager
def image_server():
    """A real HTTP server on a free loopback port serving one JPEG; yields its URL."""
    data = image(3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/a.jpg"
    finally:
        server.shutdown()
        server.server_close()


def test_tls_launch_becomes_ready_and_serves_over_tls(qwen2_vl_tiny, tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    args = ["--mode", "monolithic", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--http-port", "0",
            "--tls-cert", cert, "--tls-key", key, "--scheduler-args",
            "--allow-remote-images --allowed-media-domains 127.0.0.1", "--ready-timeout-s", "150"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPDSERVE_")}
    with launched(args, dict(env, EPDSERVE_API_KEY=KEY), READY, secrets=(KEY,)) as (found, output):
        monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)
        with Client(found["grpc"], api_key=KEY, tls_ca=cert, timeout=120) as c:
            out = c.generate("Hello", max_tokens=4, ignore_eos=True)
            assert len(out.token_ids) == 4 and out.finish_reason == "length"
        with Client(found["grpc"], api_key=KEY, timeout=10) as c:  # plaintext to a TLS port
            with pytest.raises(EPDServeError) as e:
                c.generate("Hello", max_tokens=1)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE

        ctx = ssl.create_default_context(cafile=cert)
        req = urllib.request.Request(found["http"] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
            assert [m["id"] for m in json.load(r)["data"]] == [str(qwen2_vl_tiny)]  # --model as given

        with image_server() as img_url:  # --allow-remote-images reached the scheduler: it fetches http:// images
            body = {"model": str(qwen2_vl_tiny), "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": img_url}}, {"type": "text", "text": "What is it?"}]}]}
            req = urllib.request.Request(found["http"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {KEY}",
                                                  "Content-Type": "application/json"})
            with urllib.request.urlopen(req, context=ctx, timeout=120) as r:
                assert json.load(r)["usage"]["completion_tokens"] == 2

        pwfile = Path(found["pwfile"])
        assert stat.S_IMODE(pwfile.stat().st_mode) == 0o600
        assert stat.S_IMODE(Path(found["secretfile"]).stat().st_mode) == 0o600  # the media-key secret made here
        url = found["mm"]
        with redis.Redis.from_url(url, socket_timeout=5) as r:
            with pytest.raises(redis.AuthenticationError):
                r.ping()  # NOAUTH: the private store has a password ...
        with redis.Redis.from_url(url, password=pwfile.read_text().strip(), socket_timeout=5) as r:
            assert r.ping()  # ... and the file named on the ready line holds it
