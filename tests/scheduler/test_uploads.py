"""`Uploads` (scheduler/uploads.py): ids scoped to their owner (another owner's id reads exactly as
an unknown one), a file's life (`ttl_s`, on an injected clock), the byte bound (least recently
used first), and per-tenant ownership."""
import grpc
import pytest

from epdserve.scheduler.errors import RequestError
from epdserve.scheduler.uploads import Uploads


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _add(u, owner, data=b"x" * 10):
    return u.add(owner, "a.jpg", data, "ns:key", [1, 4, 4], 4)


def _missing(fn) -> str:
    with pytest.raises(RequestError) as e:
        fn()
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    return e.value.message.replace(e.value.message.split("'")[1], "<id>")


def test_another_owner_reads_exactly_as_an_unknown_id():
    u = Uploads()
    a = _add(u, "tenant-a")
    assert u.get("tenant-a", a.file_id) is a
    theirs = _missing(lambda: u.get("tenant-b", a.file_id))
    unknown = _missing(lambda: u.get("tenant-b", "file-" + "0" * 24))
    assert theirs == unknown
    _missing(lambda: u.remove("tenant-b", a.file_id))  # nor may they delete it
    assert u.get("tenant-a", a.file_id) is a


def test_a_file_lives_ttl_s_then_is_not_found():
    clock = Clock()
    u = Uploads(ttl_s=60, clock=clock)
    f = _add(u, "")
    assert f.expires_at == f.created_at + 60
    clock.now += 59
    assert u.get("", f.file_id) is f
    clock.now += 2
    _missing(lambda: u.get("", f.file_id))
    assert len(u) == 0


def test_byte_bound_drops_least_recently_used_and_delete_forgets():
    u = Uploads(max_bytes=25)
    a, b = _add(u, ""), _add(u, "")
    u.get("", a.file_id)  # a used last: b goes first
    c = _add(u, "")
    _missing(lambda: u.get("", b.file_id))
    assert u.get("", a.file_id) is a and u.get("", c.file_id) is c
    assert u.remove("", a.file_id) is a
    _missing(lambda: u.get("", a.file_id))
    with pytest.raises(RequestError) as e:
        _add(u, "", b"y" * 26)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
