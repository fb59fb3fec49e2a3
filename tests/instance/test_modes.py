"""The modes table (instance/modes.py): every derived view agrees with `mode_pools`."""
import pytest
from hypothesis import given, strategies as st

from epdserve.instance.modes import MODE_TABLE, MODES, candidate_counts, counts_of_pools, mode_of_roles, mode_pools


@given(st.sampled_from(MODES), st.integers(0, 4), st.integers(1, 4), st.integers(1, 4))
def test_counts_of_pools_inverts_mode_pools(mode, e, p, d):
    pools = {x.roles: x.count for x in mode_pools(mode, e, p, d)}
    back = counts_of_pools(mode, pools)
    assert {x.roles: x.count for x in mode_pools(mode, *back)} == pools


@pytest.mark.parametrize("mode", MODES)
def test_a_roster_names_its_mode(mode):
    full = {x.roles for x in mode_pools(mode, 3, 1, 1)}  # E-only pools present where a mode has them
    bare = {x.roles for x in mode_pools(mode, 1, 1, 1)}
    assert mode_of_roles(full) == mode_of_roles(bare) == mode


def test_role_sets_of_no_mode():
    assert mode_of_roles({"E", "P"}) is None and mode_of_roles(set()) is None


@pytest.mark.parametrize("mode", MODES)
def test_candidates_cover_each_pool_from_one_to_n(mode):
    n = 3
    cands = candidate_counts(mode, n)
    assert len(cands) == len(set(cands)) == n ** len(next(m for m in MODE_TABLE if m.name == mode).counts_used)
    for c in cands:
        for pool in mode_pools(mode, *c):
            assert 1 <= pool.count <= n


def test_counts_a_mode_cannot_have():
    with pytest.raises(ValueError, match="not a E-P-D deployment"):
        counts_of_pools("E-P-D", {"EP": 1, "D": 1})
    with pytest.raises(ValueError, match="mode must be one of"):
        mode_pools("P-E-D")
    with pytest.raises(ValueError, match="needs at least one instance"):
        mode_pools("E-P-D", 1, 0, 1)
