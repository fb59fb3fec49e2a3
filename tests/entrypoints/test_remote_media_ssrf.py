"""Remote images without SSRF, tried from the attacker's side against real web servers on loopback
(`remote_media_sites`): every spelling of loopback and the cloud metadata address is refused
before any connection (the server counts none); `--allowed-media-domains` lets a listed host be
fetched, internal or not, and nothing else; each redirect hop is checked like the first; one
deadline bounds the whole fetch (a slow-drip body too) and the body stops at the byte cap; every
failure — refused address, DNS, refused or closed connection, HTTP status, TLS, timeout, a gRPC
port's binary answer — reads the same to the client, and no fetched byte reaches the log. Then
the same through a real HTTP front in front of a real scheduler and engine instance."""
from __future__ import annotations

import asyncio
import logging
import ssl

import openai
import pytest

from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.images import CANNOT_FETCH, fetch
from epdserve.entrypoints.http.media_address import MediaDomains
from epdserve.entrypoints.http.options import HttpOptions
from epdserve.entrypoints.http.remote_media import FetchFailed, FetchPolicy, TooLarge, fetch_remote
from epdserve.model.processor import open_image
from epdserve.net import free_port
from epdserve.request_errors import MAX_READABLE, MediaError, readable
from tests.entrypoints.http_harness import RunningFront, metered_scheduler, post
from tests.entrypoints.remote_media_sites import (GRPC_LIKE, Sites, close_at_once, drip, flood, grpc_like, hang,
                                                  redirect, serve, status)
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import image
from tests.security.certs import self_signed

JPEG = image(3)
LOOPBACK_V4 = ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "2130706433", "0x7f000001", "127.1", "0x7f.1",
               "0177.0.0.1", "[::127.0.0.1]"]


@pytest.fixture
def sites():
    s = Sites()
    yield s
    s.close()


def policy(*domains: str, max_bytes: int = 1 << 20, timeout_s: float = 5.0, tls=None) -> FetchPolicy:
    return FetchPolicy(MediaDomains(domains), max_bytes, timeout_s, tls)


def refused(url: str, pol: FetchPolicy) -> str:
    with pytest.raises(FetchFailed) as e:
        fetch_remote(url, pol)
    return e.value.reason


@pytest.mark.parametrize("host", LOOPBACK_V4)
def test_every_loopback_spelling_is_refused_before_connecting(sites, host):
    site = sites(serve(JPEG))
    reason = refused(site.url(host), policy())
    assert "resolves to" in reason and ("loopback" in reason or "embedding the IPv4 address 127.0.0.1" in reason)
    assert site.connections == 0 and site.requests == []


def test_ipv6_loopback_is_refused_before_connecting(sites):
    site = sites(serve(JPEG), host="::1")
    assert "a loopback address" in refused(site.url(), policy())
    assert site.connections == 0


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/",
                                 "http://100.100.100.200/", "http://[::ffff:169.254.169.254]/"])
def test_cloud_metadata_is_refused_without_connecting_even_when_allow_listed(url):
    host = url.split("/")[2].strip("[]")
    for pol in (policy(), policy(host)):
        reason = refused(url, pol)  # "... resolves to": refused by the address check, before any connect
        assert reason.startswith(f"{host} resolves to ") and ("metadata" in reason or "embedding" in reason)


@pytest.mark.parametrize("host,why", [
    ("10.1.2.3", "private"), ("192.168.1.1", "private"), ("100.64.0.1", "carrier"), ("[fe80::1]", "link-local"),
    ("224.0.0.1", "multicast"), ("0.0.0.0", "unspecified"), ("[fec0::1]", "site-local"), ("240.0.0.1", "reserved")])
def test_internal_ranges_are_refused_before_connecting(host, why):
    reason = refused(f"http://{host}:9/x.png", policy())
    assert reason.startswith(f"{host.strip('[]')} resolves to ") and why in reason


def test_allow_listed_localhost_is_fetched_for_real_and_nothing_else(sites):
    site = sites(serve(JPEG))
    assert fetch_remote(site.url("localhost"), policy("localhost")) == JPEG
    assert site.requests == [("/a.jpg", f"localhost:{site.port}")]  # the name in Host:, the checked address dialled
    assert fetch_remote(site.url("127.0.0.1"), policy(".example.org", "127.0.0.1")) == JPEG  # an IP entry
    assert "not in --allowed-media-domains" in refused(site.url("2130706433"), policy("localhost"))
    unlisted = refused(site.url("localhost"), policy(".localhost", "images.example.com"))  # .x: names under x
    assert "not in --allowed-media-domains" in unlisted
    assert len(site.requests) == 2


def test_user_info_and_other_schemes_are_refused(sites):
    site = sites(serve(JPEG))
    assert "user:password@" in refused(site.url("user:pw@localhost"), policy("localhost"))
    assert "neither http nor https" in refused("ftp://localhost/a.jpg", policy("localhost"))
    assert "neither http nor https" in refused("file:///etc/passwd", policy())
    assert site.connections == 0


def test_redirects_are_checked_hop_by_hop(sites):
    inner = sites(serve(JPEG))  # not allow-listed by the name the redirect uses
    for target in (inner.url("127.0.0.1"), inner.url("2130706433"), "http://169.254.169.254/latest/meta-data/"):
        outer = sites(redirect(target))
        reason = refused(outer.url("localhost"), policy("localhost"))
        assert reason.startswith("redirect 1: ")
        assert "not in --allowed-media-domains" in reason or "metadata" in reason
        assert outer.requests and inner.connections == 0
    # unlisted and no allow-list: the first hop itself is refused, so is a redirect to loopback
    assert "loopback" in refused(sites(redirect(inner.url("localhost"))).url(), policy())
    # within the allow-list a redirect is followed; a relative one too
    hop = sites(redirect(inner.url("localhost")))
    assert fetch_remote(hop.url("localhost"), policy("localhost")) == JPEG and len(inner.requests) == 1
    rel = sites(lambda h, site: (redirect("/b.jpg") if h.path == "/a.jpg" else serve(JPEG))(h, site))
    assert fetch_remote(rel.url("localhost"), policy("localhost")) == JPEG
    assert [p for p, _ in rel.requests] == ["/a.jpg", "/b.jpg"]


def test_at_most_three_redirects(sites):
    loop = sites(lambda h, site: redirect(f"/{len(site.requests)}")(h, site))
    assert "more than 3 redirects" in refused(loop.url("localhost"), policy("localhost"))
    assert len(loop.requests) == 4  # the URL and three redirects


def test_a_slow_drip_body_hits_the_whole_fetch_deadline(sites):
    site = sites(drip)
    reason = refused(site.url("localhost"), policy("localhost", timeout_s=1.0))
    assert "took longer than 1.0 s" in reason, reason  # the drip would take 500 s: the deadline ended it


def test_a_silent_server_hits_the_deadline(sites):
    site = sites(hang)
    assert "took longer than 1.0 s" in refused(site.url("localhost"), policy("localhost", timeout_s=1.0))


def test_a_too_large_body_stops_at_the_cap(sites):
    total = 64 << 20
    site = sites(flood(total))
    with pytest.raises(TooLarge):
        fetch_remote(site.url("localhost"), policy("localhost", max_bytes=100_000))
    assert site.flood_ended.wait(30)  # the server's writes ended: what it sent is final
    assert site.sent < total // 4, site.sent  # the fetcher hung up instead of reading it all
    declared = sites(serve(b"x" * 200_000))
    with pytest.raises(TooLarge, match="Content-Length 200000"):  # refused from the header alone
        fetch_remote(declared.url("localhost"), policy("localhost", max_bytes=100_000))


def test_https_dials_the_checked_address_and_verifies_the_name(sites, tmp_path):
    cert, key = self_signed(tmp_path)
    site = sites(serve(JPEG), tls=(cert, key))
    trusting = ssl.create_default_context(cafile=cert)
    assert fetch_remote(site.url("localhost", scheme="https"), policy("localhost", tls=trusting)) == JPEG
    assert "TLS" in refused(site.url("localhost", scheme="https"), policy("localhost"))  # system CAs: not trusted


def _fetch_error(url: str, **opts) -> ApiError:
    o = HttpOptions(allow_remote_images=True, **{"image_fetch_timeout_s": 1.0, **opts})
    with pytest.raises(ApiError) as e:
        asyncio.run(fetch(url, o, "image 1 (URL x)"))
    return e.value


def test_every_failure_reads_the_same_and_no_fetched_byte_is_logged(sites, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="epdserve")
    cert, key = self_signed(tmp_path)
    allowed = ("localhost", ".invalid")
    urls = {
        "refused address": sites(serve(JPEG)).url("127.0.0.1"),
        "not allow-listed": "http://images.example.com/a.jpg",
        "DNS failure": "http://no-such-host.invalid/a.jpg",
        "connection refused": f"http://localhost:{free_port()}/a.jpg",
        "closed": sites(close_at_once).url("localhost"),
        "HTTP 404": sites(status(404)).url("localhost"),
        "HTTP 500": sites(status(500)).url("localhost"),
        "TLS": sites(serve(JPEG), tls=(cert, key)).url("localhost", scheme="https"),
        "timeout": sites(hang).url("localhost"),
        "gRPC port": sites(grpc_like).url("localhost"),
    }
    errors = {why: _fetch_error(url, allowed_media_domains=() if why == "refused address" else allowed)
              for why, url in urls.items()}
    assert {(e.status, e.message) for e in errors.values()} == {(400, f"image 1 (URL x): {CANNOT_FETCH}")}, errors
    assert errors["refused address"].body()["error"]["type"] == "BadRequestError"
    debug = [r.getMessage() for r in caplog.records if CANNOT_FETCH in r.getMessage()]
    assert len(debug) == len(urls) and all(r.levelno == logging.DEBUG for r in caplog.records
                                           if CANNOT_FETCH in r.getMessage())
    assert any("resolves to 127.0.0.1, a loopback address" in m for m in debug)  # the detail is at DEBUG
    assert any("BadStatusLine" in m for m in debug)
    text = caplog.text
    assert not any(ch in text for ch in "\x00\x04\x7f\xff") and GRPC_LIKE.decode("latin-1") not in text
    too_big = _fetch_error(sites(serve(b"x" * 5000)).url("localhost"), allowed_media_domains=allowed,
                           max_image_bytes=1000)
    assert too_big.status == 400 and "larger than 1000 bytes" in too_big.message


# --- end to end: the HTTP front of a real scheduler and engine instance --------------------------

@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    inst = EngineInstance(qwen2_vl_tiny, "epd-ssrf").start()
    sched, metrics = metered_scheduler(qwen2_vl_tiny, [inst])
    fronts = {name: RunningFront(sched, metrics, served_model_name="tiny-vl", allow_remote_images=True,
                                 image_fetch_timeout_s=3.0, **kw)
              for name, kw in (("open", {}), ("listed", {"allowed_media_domains": "localhost"}))}
    yield sched, fronts
    for f in fronts.values():
        f.stop()
    sched.stop()
    inst.stop()


def _chat(url: str) -> dict:
    return {"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}


def test_through_the_http_front(served, sites, caplog):
    caplog.set_level(logging.DEBUG)
    sched, fronts = served
    site = sites(serve(JPEG))
    with openai.OpenAI(base_url=fronts["listed"].base_url, api_key="none", max_retries=0, timeout=120) as oai:
        out = oai.chat.completions.create(**_chat(site.url("localhost")))
    assert out.usage.completion_tokens == 2 and len(site.requests) == 1  # the allow-listed host, fetched for real

    grpc_host, grpc_port = sched.server.address.rsplit(":", 1)
    attempts = [("open", site.url("127.0.0.1")), ("open", site.url("[::ffff:127.0.0.1]")),
                ("open", site.url("2130706433")), ("listed", site.url("127.0.0.1")),
                ("listed", sites(redirect(site.url("127.0.0.1"))).url("localhost")),
                ("listed", f"http://localhost:{grpc_port}/a.jpg")]  # the scheduler's own gRPC port
    for front, url in attempts:
        code, body = post(fronts[front], "/v1/chat/completions", _chat(url))
        assert code == 400 and body["error"]["message"].endswith(f": {CANNOT_FETCH}"), (url, body)
        assert body["error"]["type"] == "BadRequestError"
    assert len(site.requests) == 1  # no refused attempt reached it
    assert "\x00" not in caplog.text and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_decoder_error_never_quotes_the_input():
    """What an image URL answered reaches a 400's text only as words (PIL's and the scheduler's path)."""
    with pytest.raises(MediaError) as e:
        open_image(GRPC_LIKE)
    assert str(e.value).startswith(f"the image is not a readable image ({len(GRPC_LIKE)} bytes)")
    quoted = readable(SyntaxError("broken PNG file (chunk b'\\x00\\x01\\xfe\\xff')"))
    assert quoted == "broken PNG file (chunk <bytes>)"
    raw = readable(ValueError("bad header " + GRPC_LIKE.decode("latin-1") + " " + "y" * 500))
    assert raw.startswith("bad header ?") and raw.isascii() and raw.isprintable() and len(raw) <= MAX_READABLE
