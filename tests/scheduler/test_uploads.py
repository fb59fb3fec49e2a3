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


def test_a_tenants_uploads_evict_only_its_own_files_within_its_share():
    """B fills its share: its own least recently used files go, never A's; past the store's
    room with only others' files left, or with one file over a share, B is refused naming the limit."""
    u = Uploads(max_bytes=50, tenant_max_bytes=30, tenant_max_files=2)
    a = _add(u, "a")
    b1, b2 = _add(u, "b"), _add(u, "b")
    b3 = _add(u, "b")  # B's third file: its share holds two, its oldest goes
    _missing(lambda: u.get("b", b1.file_id))
    assert u.get("a", a.file_id) is a and u.get("b", b2.file_id) is b2 and u.get("b", b3.file_id) is b3
    big = _add(u, "b", b"z" * 30)  # its share in bytes: both of B's others go, A's stays
    _missing(lambda: u.get("b", b2.file_id))
    _missing(lambda: u.get("b", b3.file_id))
    assert u.get("a", a.file_id) is a and u.get("b", big.file_id) is big
    with pytest.raises(RequestError) as e:
        _add(u, "b", b"z" * 31)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--upload-tenant-max-bytes" in e.value.message
    c = _add(u, "c")  # 50 bytes now: a 10, b 30, c 10
    with pytest.raises(RequestError) as e:  # the store full of A's, B's and C's: D evicts nobody
        _add(u, "d")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--upload-max-bytes" in e.value.message
    assert all(u.get(o, f.file_id) is f for o, f in (("a", a), ("b", big), ("c", c)))


def test_expired_files_of_anyone_make_room_first():
    clock = Clock()
    u = Uploads(ttl_s=60, max_bytes=20, clock=clock)
    a = _add(u, "a")
    b = _add(u, "b")
    clock.now += 61  # both dead: C's upload takes their room, not a refusal
    c = _add(u, "c")
    _missing(lambda: u.get("a", a.file_id))
    _missing(lambda: u.get("b", b.file_id))
    assert u.get("c", c.file_id) is c and len(u) == 1
