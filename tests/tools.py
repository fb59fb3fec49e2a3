"""`require_tool`: the external programs a test runs (redis-server, redis-cli, curl, shellcheck):
skipped where one is missing on a developer's machine, FAILED under `CI=true` — CI installs every
tool the suite needs (.ci/run), so a missing one is a broken CI, never a silent skip."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def find_tool(name: str) -> str | None:
    """`name` on PATH, else beside this interpreter (pip's console scripts, when the venv is not
    activated)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def require_tool(*names: str, why: str = "", module: bool = False) -> str:
    """The path of the first of `names` (all must be found): a skip where one is missing, a
    failure under CI=true. `module`: called at a test module's top level (skips the module)."""
    paths = {n: find_tool(n) for n in names}
    missing = [n for n, p in paths.items() if p is None]
    if missing:
        msg = f"{', '.join(missing)} not installed" + (f": {why}" if why else "")
        if in_ci():
            pytest.fail(f"CI=true: {msg} (CI must install it)", pytrace=False)
        pytest.skip(msg, allow_module_level=module)
    return paths[names[0]]
