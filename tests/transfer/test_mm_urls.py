"""MM Store URLs (urls.py): the topology each names, the member lists, and redaction."""
import pytest

from epdserve.transfer.mm_store.connection import RedisConnection, ServerHealth
from epdserve.transfer.mm_store.urls import CLUSTER, SENTINEL, SINGLE, parse, redact


def test_single_server_urls_pass_through():
    for url in ("redis://h:1/0", "rediss://:pw@h:1/0?ssl_ca_certs=/ca.pem", "unix:///run/r.sock"):
        u = parse(url)
        assert (u.kind, u.node_url, u.members) == (SINGLE, url, ())


def test_cluster_url_members_auth_and_options():
    u = parse("redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7002/?socket_timeout=2")
    assert u.kind == CLUSTER and not u.tls
    assert u.members == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert u.node_url == "redis://app:s3cret@10.0.0.1:7000/0?socket_timeout=2"
    assert parse("rediss+cluster://h:1").node_url == "rediss://h:1/0" and parse("rediss+cluster://h:1").tls
    with pytest.raises(ValueError, match="database 0"):
        parse("redis+cluster://h:1/3")


def test_sentinel_url_service_db_and_sentinel_password():
    u = parse("redis+sentinel://:data@s1:26380,s2/epd/2?sentinel_password=sent&socket_timeout=1")
    assert u.kind == SENTINEL and u.service == "epd"
    assert u.members == (("s1", 26380), ("s2", 26379))
    assert u.node_url == "redis://:data@s1:26380/2?socket_timeout=1"
    assert u.sentinel_auth == {"password": "sent"}
    with pytest.raises(ValueError, match="service_name"):
        parse("redis+sentinel://s1:26379")


def test_bad_urls_name_no_password():
    with pytest.raises(ValueError) as e:
        parse("http://:topsecret@h:1")
    assert "topsecret" not in str(e.value)
    with pytest.raises(ValueError) as e:
        parse("redis+cluster://:topsecret@h:notaport")
    assert "topsecret" not in str(e.value)
    with pytest.raises(ValueError):
        RedisConnection("memcached://h:1")


def test_redact():
    assert redact("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact("redis+cluster://u:pw@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact("redis+sentinel://s:1/m?sentinel_password=x&db=1") == "redis+sentinel://s:1/m?sentinel_password=***&db=1"
    assert redact("redis://h:1") == "redis://h:1"


def test_a_flapping_store_warns_once(caplog):
    """A cluster with one master gone for good: down, up (a call on a live slot), down again ...
    Failures within quiet_s of a recovery are DEBUG; once it stayed up for quiet_s, a failure warns."""
    now = [0.0]
    h = ServerHealth("x", backoff_s=1.0, max_backoff_s=1.0, clock=lambda: now[0], quiet_s=60.0)
    caplog.set_level("DEBUG", logger="epdserve.transfer.mm_store")
    for _ in range(5):
        h.record_failure(ConnectionError("node down"))
        now[0] += 1.0
        h.record_success()
    now[0] += 61.0
    h.record_failure(ConnectionError("node down"))
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    infos = [r for r in caplog.records if r.levelname == "INFO"]
    assert len(warnings) == 2 and len(infos) == 1 and h.outages == 6
