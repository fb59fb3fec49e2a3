"""Roles are data: `epdserve/roles.py`'s table is the only place a role string is tested.

The package's source is searched (its syntax trees, so docstrings and comments do not count) for
a role or stage string tested as a string anywhere but the table's module: a comparison with a
role literal (`"D" in roles`, `roles == "EPD"`, `role != "E"`, `kind in ("P", "D")`, `s in "PD"`),
a loop over one (`for s in "EPD"`), or a string method on one (`"EPD".index(...)`). What a role
set means is read off its record (`role_set(name).decodes`, `.coupled`, `.encodes_inline` ...);
stage and pool keys are the table's constants (`ENCODE`, `PREFILL`, `DECODE`, `COUPLED`).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from epdserve.roles import ROLE_TABLE, ROLES, parse_roles, role_set

PACKAGE = Path(__file__).resolve().parents[1] / "epdserve"
TABLE = PACKAGE / "roles.py"
ROLE_STRINGS = frozenset(ROLES) | {"PE", "DE", "DP", "EDP"}  # names, and letters in another order


def _is_role(node: ast.AST) -> bool:
    """A role literal, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in ROLE_STRINGS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and any(_is_role(e) for e in node.elts)
    return False


def role_string_tests(source: str) -> list[tuple[int, str]]:
    """(line, code) of every role string test in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Compare):
            hit = any(_is_role(x) for x in [node.left, *node.comparators])
        elif isinstance(node, (ast.For, ast.comprehension)):
            hit = isinstance(node.iter, ast.Constant) and _is_role(node.iter)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = _is_role(node.func.value)
        if hit:
            found.append((node.lineno if hasattr(node, "lineno") else node.iter.lineno, ast.unparse(node)))
    return found


def test_no_role_string_test_outside_the_role_table():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == TABLE or "proto_gen" in path.parts:
            continue
        for line, code in role_string_tests(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {code}")
    assert not offenders, "role strings tested outside epdserve/roles.py (ask the RoleSet):\n" + "\n".join(offenders)


@pytest.mark.parametrize("code", [
    '"D" in roles', 'roles == "EPD"', 'role != "E"', 'kind in ("P", "D")', '"P" not in r.roles',
    'any(s in role for s in "PD")', '"EPD".index(x)', 'w.kind == "P+E"', 'x in "EPD"',
])
def test_the_search_finds_each_shape_of_role_test(code):
    assert role_string_tests(code)


@pytest.mark.parametrize("code", ['"""D" in roles, roles == "EPD": prose"""', 'role_set(r).decodes',
                                  'stage == DECODE', 'lease.done("P")', 'x == "PDF"'])
def test_the_search_passes_prose_records_and_constants(code):
    assert not role_string_tests(code)


def test_every_record_reads_as_its_name_says():
    for name, rs in ROLE_TABLE.items():
        assert parse_roles(name) is rs is role_set(name) and str(rs) == name
        assert rs.holds_kv == (rs.prefills or rs.decodes)
        for w in rs.worker_sets:  # a worker's record takes one pool's calls, and is its own worker
            assert w.workers == (w.name,) and rs.takes(w.worker_key) and w.takes(w.worker_key)
        assert rs.stages == frozenset().union(*(w.stages for w in rs.worker_sets))
    assert parse_roles("p + e").encodes_inline and parse_roles("EPD").encodes_inline
    assert not parse_roles("PD").encodes_inline and parse_roles("PD").coupled and parse_roles("EPD").coupled
    assert parse_roles("EP").workers == ("E", "P") and parse_roles("ED").serves == {"E", "D"}
    assert parse_roles("P+E").serves == {"P"} and parse_roles("P+E").sends_kv and parse_roles("ED").receives_kv
    assert parse_roles("EPD").worker_key == "PD" and parse_roles("P+E").worker_key == "P"
    assert parse_roles("EP").rpcs == ("Encode", "Prefill") and parse_roles("EPD").rpcs == ("Generate",)
    assert parse_roles("P+E").rpcs == ("Prefill",) and parse_roles("ED").rpcs == ("Encode", "Decode")
    assert parse_roles("EP").encodes_for_others and not parse_roles("EPD").encodes_for_others
    assert parse_roles("E").encode_only and not parse_roles("EP").encode_only and not parse_roles("E").holds_kv
    with pytest.raises(ValueError, match="roles must be one of"):
        role_set("pe")  # a record is looked up by its canonical name; parsing is `parse_roles`
