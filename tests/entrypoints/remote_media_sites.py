"""Real local web servers for the remote-media SSRF tests: `Site` is a `ThreadingHTTPServer` on a
loopback port picked by the kernel (port 0), in a thread, that counts every connection it accepts
and records every request; what it answers is a `behave(handler)` function (the ones here: serve
bytes, a status, a redirect, close at once, hang, drip the body, flood it, answer binary bytes as a
gRPC port does). `Sites` starts them and stops them all at the end of a test."""
from __future__ import annotations

import http.server
import socket
import ssl
import threading
import time

GRPC_LIKE = b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff\x00\x04\x00\x10\x00\x00"  # HTTP/2 SETTINGS


class Site:
    def __init__(self, behave, host: str = "127.0.0.1", tls: tuple[str, str] | None = None):
        site = self
        self.connections = 0
        self.requests: list[tuple[str, str]] = []  # (path, Host header)
        self.sent = 0  # body bytes written by `flood`
        self.flood_ended = threading.Event()  # `flood` stopped writing (the client hung up, or all was sent)
        self.stop = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                site.requests.append((self.path, self.headers.get("Host", "")))
                self.close_connection = True
                behave(self, site)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

            def verify_request(self, request, client_address):
                site.connections += 1
                return True

            def handle_error(self, request, client_address):
                pass  # a client that went away (the fetcher's cap or deadline) is expected here

        self.server = Server((host, 0), Handler)
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.host, self.port = host, self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, host: str | None = None, path: str = "/a.jpg", scheme: str = "http") -> str:
        host = host or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"{scheme}://{host}:{self.port}{path}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


class Sites:
    def __init__(self):
        self._all: list[Site] = []

    def __call__(self, behave, **kw) -> Site:
        site = Site(behave, **kw)
        self._all.append(site)
        return site

    def close(self) -> None:
        for site in self._all:
            site.close()


def serve(data: bytes, content_type: str = "image/jpeg"):
    def behave(h, site):
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return behave


def status(code: int):
    def behave(h, site):
        h.send_response(code)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return behave


def redirect(location: str, code: int = 302):
    def behave(h, site):
        h.send_response(code)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return behave


def close_at_once(h, site):
    """Read the request, answer nothing, close."""


def hang(h, site):
    """Read the request, answer nothing, keep the connection open until the site stops."""
    site.stop.wait(30)


def grpc_like(h, site):
    """Answer as a gRPC (HTTP/2) port answers an HTTP/1.1 request: binary frames, then close."""
    h.wfile.write(GRPC_LIKE)


def drip(h, site):
    """Declare 10,000 bytes, then send one every 50 ms (each read returns quickly; the whole never ends)."""
    h.send_response(200)
    h.send_header("Content-Length", "10000")
    h.end_headers()
    for _ in range(10000):
        if site.stop.is_set():
            return
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.05)


def flood(total: int):
    """A body of `total` bytes with no Content-Length (ends when the connection closes), in 64 KiB
    writes; `site.sent` counts what went out before the client hung up."""
    def behave(h, site):
        h.send_response(200)
        h.send_header("Connection", "close")
        h.end_headers()
        chunk = b"\xff" * 65536
        try:
            while site.sent < total:
                h.wfile.write(chunk)
                site.sent += len(chunk)
        except OSError:
            pass
        finally:
            site.flood_ended.set()
    return behave
