"""The import contract in .importlinter holds: epdserve's imports point down its layers
(lint-imports, import-linter's own command, run from this interpreter's environment), and
docs/architecture.md's layer list is that contract's list, line for line."""
from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _layers() -> list[str]:
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    return [line.strip() for line in config["importlinter:contract:layers"]["layers"].splitlines() if line.strip()]


def test_imports_point_down_the_layers():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", str(REPO / ".importlinter")], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def test_the_architecture_doc_draws_the_contract():
    doc = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers: \.importlinter -->\n```\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md lost its layer list (the block after '<!-- layers: .importlinter -->')"
    drawn = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]
    assert drawn == _layers()
