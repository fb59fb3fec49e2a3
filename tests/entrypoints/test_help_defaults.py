"""Every option of every `epdserve` command shows its declared default in `--help`, taken from the
declaration (`commands._ShowsDefaults`, `settings._help`): no help string spells out by hand a
"(default N)" that the declaration already holds."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from epdserve.bench.cli import BENCHMARKS
from epdserve.entrypoints.cli import COMMANDS, build_parser

PACKAGE = Path(__file__).resolve().parents[2] / "epdserve"


def _parsers():
    """(name, parser) of every command and benchmark, each built as its own `--help` builds it."""
    for words in [(name,) for name in COMMANDS if name != "bench"] + [("bench", name) for name in BENCHMARKS]:
        root = build_parser(list(words))
        p = root
        for w in words:
            sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
            p = sub.choices[w]
        yield " ".join(words), p


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text.strip("'\"")


def test_every_default_is_shown_once_and_from_its_declaration():
    checked = 0
    for name, p in _parsers():
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or a.help in (None, argparse.SUPPRESS):
                continue
            shown = fmt._get_help_string(a)
            d = a.default
            if d not in (None, argparse.SUPPRESS, "", []) and not isinstance(d, bool):
                assert "default" in shown, f"{name} {a.option_strings[0]}: its default {d!r} is not shown"
                checked += 1
    assert checked > 50  # the parsers were read


# a declaration whose help string ends in "(default Y)" for its own default X: `default=X, help="..."`
# (argparse) or `setting(X, help="...")`
HAND = [re.compile(r'default=([^,]+),\s*help=f?"[^"]*?\s*\(default ([^);]+)\)"'),
        re.compile(r'setting\(\s*([^,]+),\s*(?:check=\([^)]*\),\s*)?help=f?"[^"]*?\s*\(default ([^);]+)\)"')]


def test_no_help_string_spells_out_its_declared_default():
    found = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for pat in HAND:
            for m in pat.finditer(text):
                declared = m.group(1).strip()
                try:
                    declared = float(eval(declared, {}))  # a literal or literal arithmetic (20 * 1024)
                except Exception:  # noqa: BLE001 - a name: compared as written
                    pass
                if _number(m.group(2)) == declared or str(declared).strip("'\"") == m.group(2):
                    found.append(f"{path.relative_to(PACKAGE.parent)}: {m.group(0)[:80]}")
    assert not found, "\n".join(found)
