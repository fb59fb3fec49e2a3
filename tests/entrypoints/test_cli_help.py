"""`epdserve --help` and each command's `--help` build their parser without importing torch or
transformers (`entrypoints/cli.py` builds only the named command's parser; command modules keep
heavy imports in their run functions): each runs in a fresh interpreter under `-X importtime`,
which lists every module the process imported."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from epdserve.bench.cli import BENCHMARKS
from epdserve.entrypoints.cli import COMMANDS

HEAVY = ("torch", "transformers")
CASES = [(), *((name,) for name in COMMANDS),
         *(("bench", name) for name in BENCHMARKS)]


def imported_modules(stderr: str) -> set[str]:
    """Top-level package names in `-X importtime` output (`import time: self | cumulative | name`)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name.split(".")[0])
    return names


@pytest.mark.parametrize("words", CASES, ids=lambda w: " ".join(w) or "epdserve")
def test_help_prints_without_importing_torch(words):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "epdserve.entrypoints.cli", *words, "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    prog = " ".join(("epdserve", *words))
    assert r.stdout.startswith(f"usage: {prog}"), r.stdout[:500]
    modules = imported_modules(r.stderr)
    assert "epdserve" in modules and "argparse" in modules  # the importtime listing was read
    assert not modules & set(HEAVY), f"`{prog} --help` imported {sorted(modules & set(HEAVY))}"


def test_top_level_help_lists_every_command_and_launch_help_its_flags():
    out = subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    for name, cmd in COMMANDS.items():
        assert name in out and cmd.help[:40] in out
    out = subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "bench", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    assert all(name in out for name in BENCHMARKS)
    out = subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "scheduler", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    assert "epdserve scheduler ready:" in out  # the module docstring is its --help text
    assert "--tls-cert" in out and "--served-model-name" in out


def flag_help(out: str, flag: str) -> str:
    """The help text of `flag` in an argparse `--help` output: its line and its continuation lines."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(flag + " ")
                 or line.strip() == flag or line.lstrip().startswith(flag + ","))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * 6):  # the next flag (indented 2) or group
            break
        block.append(line)
    return " ".join(" ".join(block).split())


@pytest.mark.parametrize("command,flag", [("launch", "--mode"), ("scheduler", "--controller")])
def test_experimental_features_say_so_in_their_help(command, flag):
    """The role controller (`--mode auto`) is experimental: its flags' help says so, with the README
    figure that measured it."""
    out = subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", command, "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "100"}).stdout
    text = flag_help(out, flag)
    assert "experimental" in text.lower() and "README" in text, text
