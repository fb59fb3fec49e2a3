"""The `epdserve` command: one sub-command per module, each registering itself via `add_parser`.

Sub-commands are listed in `COMMANDS` (name → module path and the help line shown in
`epdserve --help`); each module exposes `add_parser(subparsers)` which registers its parser and
sets `func(args) -> int`, the common part through `add_command` (its module docstring is its
`--help` text). A command group (`bench`) takes `add_parser(subparsers, argv)` and does the same
one level down (`add_commands`).

Parsing is lazy: `build_parser(argv)` imports only the module of the command `argv` names; every
other command is listed by its help line alone. So `epdserve --help` and `epdserve CMD --help`
import no command module but CMD's, and command modules keep heavy imports (torch, transformers,
gRPC, numpy) inside their run functions: `--help` answers in well under a second
(tests/entrypoints/test_cli_help.py checks that torch is never imported for it).

`Parser` (every epdserve parser) lets a `FlagsArg` option take a value that starts with `-`:
`epdserve launch --scheduler-args "--allow-remote-images"` (plain argparse reads the value as an
unknown option and stops with "expected one argument").
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str  # exposes add_parser(subparsers) (a group: add_parser(subparsers, argv))
    help: str  # its line in the parent's command list
    group: bool = False  # it has sub-commands of its own


COMMANDS = {
    "demo-model": Command("epdserve.model.demo",
                          "write a random-weight Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) checkpoint for demos and tests"),
    "bench": Command("epdserve.bench.cli", "run a benchmark (writes JSON + a table)", group=True),
    "profile": Command("epdserve.bench.profile",
                       "per-stage cost on this device (vision, prefill, decode, bytes moved) -> JSON"),
    "plan": Command("epdserve.planner.cli",
                    "predict each mode's SLO goodput from a profile + workload; write the best as a launch config"),
    "instance": Command("epdserve.entrypoints.instance_cli", "run one E/P/D instance process"),
    "launch": Command("epdserve.entrypoints.launch", "launch a deployment mode (scheduler + instances) on this machine"),
    "scheduler": Command("epdserve.entrypoints.scheduler_cli", "run the global gRPC scheduler"),
    "build-ops": Command("epdserve.entrypoints.build_ops_cli",
                         "build the native paged-KV operators (csrc/) ahead of time"),
    "doctor": Command("epdserve.entrypoints.doctor_cli", "check this machine (and named servers) for epdserve"),
}


class FlagsArg(argparse.Action):
    """An option whose one value is more flags for a child command, e.g. ``--scheduler-args "--x 1"``:
    the word after it is its value even when that word starts with ``-`` (`Parser` sees to it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """argparse, but the word after a `FlagsArg` option is always that option's value (it is glued
    to it as ``--opt=VALUE`` before parsing; words after a bare ``--`` are left alone). Its
    sub-command parsers are `Parser`s too (argparse makes them of the parent's class)."""

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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (only its command built); None: every command built."""
    parser = Parser(
        prog="epdserve",
        description="EPD-disaggregated serving for vision-language models (Encode / Prefill / Decode).",
    )
    parser.add_argument("--log-level", default="INFO", help="python logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub, COMMANDS, argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":  # python -m: run the imported module's main, whose classes command modules share
    from epdserve.entrypoints.cli import main as _main

    sys.exit(_main())
