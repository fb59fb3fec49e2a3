"""LocalFeatureCache: LRU by bytes, in-flight protocol."""
import threading

import pytest
import torch

from epdserve.transfer.mm_store.cache import LocalFeatureCache


def _feat(kib):
    return [torch.zeros(kib * 256, dtype=torch.float32)]  # kib KiB


def test_lru_evicts_least_recently_used_by_bytes():
    cache = LocalFeatureCache(capacity_bytes=3 * 1024)
    for k in "abc":
        assert cache.put(k, _feat(1))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("d", _feat(1))
    assert "b" not in cache and all(k in cache for k in "acd")
    assert cache.stats()["bytes"] == 3 * 1024 and cache.stats()["evictions"] == 1


def test_entry_larger_than_capacity_is_not_cached():
    cache = LocalFeatureCache(capacity_bytes=1024)
    assert not cache.put("big", _feat(2))
    assert "big" not in cache and cache.stats()["bytes"] == 0


def test_device_placement_on_insert():
    cache = LocalFeatureCache(capacity_bytes=1 << 20, device="cpu")
    cache.put("k", [torch.ones(3, dtype=torch.bfloat16)])
    (t,) = cache.get("k")
    assert t.device == torch.device("cpu") and t.dtype == torch.bfloat16


def test_inflight_marking_and_wait():
    cache = LocalFeatureCache(capacity_bytes=1 << 20)
    cache.put("cached", _feat(1))
    assert cache.mark_inflight(["a", "cached", "a", "b"]) == ["a", "b"]
    assert cache.mark_inflight(["a"]) == []
    cache.abandon(["b"])
    assert cache.wait_for("b", timeout_s=30, inflight_only=True) is None  # fetch ended: no wait

    got = []
    waiter = threading.Thread(target=lambda: got.append(cache.wait_for("a", timeout_s=30, inflight_only=True)))
    waiter.start()
    cache.put("a", _feat(1))
    waiter.join()
    assert got[0] is not None and not cache.is_inflight("a")


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity_bytes"):
        LocalFeatureCache(0)
