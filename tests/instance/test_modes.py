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


def test_each_pool_takes_its_stages_degree():
    """Issue 48 item 1: E-only pools the encode degree; pools that prefill for a decode elsewhere the
    prefill degree, pools that decode what was prefilled elsewhere the decode degree (0: the language
    model's); pools that prefill and decode always the language model's."""
    from epdserve.instance.modes import pool_degree

    got = {r: pool_degree(r, 2, encode_degree=1, prefill_degree=3, decode_degree=4)
           for r in ("E", "P", "EP", "P+E", "D", "ED", "PD", "EPD")}
    assert got == {"E": 1, "P": 3, "EP": 3, "P+E": 3, "D": 4, "ED": 4, "PD": 2, "EPD": 2}
    assert {r: pool_degree(r, 2, 5) for r in ("E", "P", "D", "PD")} == {"E": 5, "P": 2, "D": 2, "PD": 2}
    with pytest.raises(ValueError, match="--prefill-tensor-parallel-size must be >= 0"):
        pool_degree("P", 1, 1, -1)
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        pool_degree("PD", 0)


@pytest.mark.parametrize("mode", MODES)
def test_a_mode_with_a_kv_hop_runs_only_at_the_pairs_the_hop_carries(mode, monkeypatch):
    """`pool_degrees` asks kv_layout.hop_carries for the P pool's and the D pool's degrees — it carries
    every pair (transfer/kv/links.py); here it is made to refuse one, P 2 to D 1 —: every pair it carries
    is let through, one it refuses is refused naming both degrees; a mode without P->D pairs
    (monolithic, E-PD) runs at any degree."""
    from epdserve import kv_layout
    from epdserve.instance.modes import pool_degrees
    from epdserve.roles import role_set

    assert all(kv_layout.hop_carries(p, d) for p in range(1, 9) for d in range(1, 9))
    monkeypatch.setattr(kv_layout, "hop_carries", lambda p, d: (p, d) != (2, 1))
    pools = mode_pools(mode, 2, 1, 1)
    has_hop = any(role_set(p.roles).sends_kv for p in pools)
    for p in range(1, 5):
        for d in range(1, 5):
            if not has_hop or (p, d) != (2, 1):
                got = pool_degrees(pools, 8, 1, p, d)
                assert len(got) == len(pools)
            else:
                with pytest.raises(ValueError, match=rf"prefill at tensor_parallel_size {p} .* decode at "
                                                     rf"tensor_parallel_size {d} .* from TP{p} to TP{d}"):
                    pool_degrees(pools, 8, 1, p, d)