"""Every module and subpackage of epdserve is named in its package's docstring (issue 25).

A package's `__init__.py` docstring says what each of its modules owns; a module it does not
name is a module a reader cannot find. Named means the module's name appears as a word
(`pair_store` or `pair_store.py`). Only proto_gen's generated modules are exempt.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "epdserve"
GENERATED = {"proto_gen"}  # protoc output: its modules are named by the .proto files


def packages() -> list[Path]:
    return sorted(p.parent for p in ROOT.rglob("__init__.py")
                  if not GENERATED.intersection(p.relative_to(ROOT).parts) and "__pycache__" not in p.parts)


def members(pkg: Path) -> list[str]:
    mods = [p.stem for p in pkg.glob("*.py") if p.stem != "__init__"]
    subs = [p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()]
    return sorted(mods + subs)


def test_packages_are_found():
    found = {p.relative_to(ROOT).as_posix() for p in packages()}
    assert {".", "engine", "instance", "scheduler", "transfer/mm_store"} <= found


@pytest.mark.parametrize("pkg", packages(), ids=lambda p: p.relative_to(ROOT.parent).as_posix())
def test_package_docstring_names_every_module(pkg: Path):
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    missing = [m for m in members(pkg) if not re.search(rf"(?<![\w.]){re.escape(m)}\b", doc)]
    assert not missing, f"{pkg.relative_to(ROOT.parent)}/__init__.py's docstring does not name: {', '.join(missing)}"
