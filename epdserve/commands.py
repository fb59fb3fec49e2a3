"""Command registration for every `epdserve` sub-command, importable from any layer.

Owns the kit a command module uses to register itself: `Command` (a module path and its help
line), `add_command` (one sub-command: its `--help` text is the module docstring, `run(args) -> int`
its body), `add_commands` (a table of commands, importing only the one the arguments name),
`Parser` and `FlagsArg`. It imports nothing of epdserve and no heavy library, so a command module
of any package (bench, planner, entrypoints) registers through it without importing the
`entrypoints` package, and `epdserve --help` stays light (tests/entrypoints/test_cli_help.py).
The command tables themselves live with their owners (`entrypoints/cli.py` COMMANDS,
`bench/cli.py` BENCHMARKS).

`Parser` (every epdserve parser) shows each option's default from its declaration (`_ShowsDefaults`:
no help string spells out "(default N)" by hand) and lets a `FlagsArg` option take a value that starts with `-`:
`epdserve launch --scheduler-args "--allow-remote-images"` (plain argparse reads the value as an
unknown option and stops with "expected one argument").
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str  # exposes add_parser(subparsers) (a group: add_parser(subparsers, argv))
    help: str  # its line in the parent's command list
    group: bool = False  # it has sub-commands of its own


class FlagsArg(argparse.Action):
    """An option whose one value is more flags for a child command, e.g. ``--scheduler-args "--x 1"``:
    the word after it is its value even when that word starts with ``-`` (`Parser` sees to it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _ShowsDefaults:
    """An option's help ends with its declared default, unless the help already speaks of its
    default or there is none to show (None, a flag, empty)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in text or d is None or d is argparse.SUPPRESS
                or isinstance(d, bool) or d == "" or d == []):
            return text
        return f"{text} (default %(default)s)"


class HelpFormatter(_ShowsDefaults, argparse.HelpFormatter):
    """argparse's formatter, defaults shown from the declarations."""


class RawDescriptionFormatter(_ShowsDefaults, argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (module docstrings), defaults shown from the declarations."""


_OURS = {argparse.HelpFormatter: HelpFormatter, argparse.RawDescriptionHelpFormatter: RawDescriptionFormatter}


class Parser(argparse.ArgumentParser):
    """argparse, but the word after a `FlagsArg` option is always that option's value (it is glued
    to it as ``--opt=VALUE`` before parsing; words after a bare ``--`` are left alone), and help
    formatted so that each option shows its declared default (asked for argparse's plain or
    raw-description formatter, it gets ours of the same kind). Its sub-command parsers are `Parser`s too (argparse makes them of the parent's class)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kw):
        super().__init__(*args, formatter_class=_OURS.get(formatter_class, formatter_class), **kw)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        takes_flags = {o for a in self._actions if isinstance(a, FlagsArg) for o in a.option_strings}
        glued, i = [], 0
        while i < len(args):
            word = args[i]
            if word == "--":
                glued += args[i:]
                break
            if word in takes_flags and i + 1 < len(args):
                glued.append(f"{word}={args[i + 1]}")
                i += 2
                continue
            glued.append(word)
            i += 1
        return super().parse_known_args(glued, namespace)


def add_command(subparsers, name: str, run, help: str, doc: str | None) -> argparse.ArgumentParser:
    """Register sub-command `name`: `help` is its line in the command list, `doc` (the module's
    docstring) its `--help` text, `run(args) -> int` what it does."""
    p = subparsers.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=run)
    return p


def add_commands(subparsers, commands: dict[str, Command], argv: list[str] | None) -> None:
    """Register `commands` on `subparsers`. `argv`: the arguments after the parent command: only
    the command it names (its first word that is a command's name) is imported and built; the
    others get a placeholder parser that carries their help line. None: build every command."""
    chosen = None if argv is None else next((a for a in argv if a in commands), "")
    for name, cmd in commands.items():
        if chosen is not None and name != chosen:
            subparsers.add_parser(name, help=cmd.help, add_help=False)  # listed, never parsed
            continue
        module = importlib.import_module(cmd.module)
        if cmd.group:
            rest = None if argv is None else argv[argv.index(name) + 1:]
            module.add_parser(subparsers, rest)
        else:
            module.add_parser(subparsers)
