"""ByteLRU (the one byte-bounded LRU) and the in-process LocalFeatureProvider built on it."""
import pytest
import torch

from epdserve.seams.byte_lru import ByteLRU, tensors_nbytes
from epdserve.seams.feature_provider import FeatureStats, LocalFeatureProvider


def _feat(kib):
    return [torch.zeros(kib * 128, dtype=torch.float32), torch.zeros(kib * 256, dtype=torch.bfloat16)]  # kib KiB


def test_evicts_least_recently_used_by_bytes_and_counts_it():
    lru = ByteLRU(3 * 1024)
    for k in "abc":
        assert lru.put(k, _feat(1))
    assert lru.get("a") is not None  # a is now the most recent
    assert "b" in lru  # `in` does not refresh b
    assert lru.put("d", _feat(2))
    assert set(lru) == {"a", "d"} and lru.nbytes == 3 * 1024 and lru.evictions == 2


def test_too_large_is_refused_and_drops_the_old_value():
    lru = ByteLRU(1024)
    assert lru.put("k", _feat(1)) and not lru.put("k", _feat(2))
    assert "k" not in lru and lru.nbytes == 0 and lru.evictions == 0


def test_replacing_a_key_accounts_its_new_size():
    lru = ByteLRU(4 * 1024)
    lru.put("k", _feat(1))
    lru.put("k", _feat(3))
    assert lru.nbytes == tensors_nbytes(_feat(3)) == 3 * 1024 and len(lru) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_capacity_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="capacity_bytes"):
        ByteLRU(bad)


def test_local_provider_reports_feature_stats():
    prov = LocalFeatureProvider(max_bytes=2 * 1024)
    prov.save("a", _feat(1))
    prov.save("big", _feat(4))  # larger than the whole bound: not kept, prefill recomputes
    assert prov.contains("a") and not prov.contains("big")
    assert prov.load("a") is not None and prov.load("big") is None
    st = prov.stats()
    assert isinstance(st, FeatureStats)
    assert (st.hits_local, st.misses, st.saves, st.save_failures) == (1, 1, 1, 1)
    assert (st.hits, st.lookups, st.cached_entries, st.cached_bytes, st.cache_capacity_bytes) == (1, 2, 1, 1024, 2048)
    with pytest.raises(AttributeError):
        st.hits_local = 5  # a frozen snapshot
