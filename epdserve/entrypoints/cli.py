"""The `epdserve` command: one sub-command per module, each registering itself via `add_parser`.

Sub-commands are listed in `COMMANDS` (name → module path and the help line shown in
`epdserve --help`); each module exposes `add_parser(subparsers)` which registers its parser and
sets `func(args) -> int`, the common part through `epdserve.commands.add_command` (its module
docstring is its `--help` text). A command group (`bench`) takes `add_parser(subparsers, argv)`
and does the same one level down (`add_commands`). The registration kit (`Command`, `Parser`,
`FlagsArg`, `add_command(s)`) lives in `epdserve/commands.py`, so no command module imports this one.

Parsing is lazy: `build_parser(argv)` imports only the module of the command `argv` names; every
other command is listed by its help line alone. So `epdserve --help` and `epdserve CMD --help`
import no command module but CMD's, and command modules keep heavy imports (torch, transformers,
gRPC, numpy) inside their run functions: `--help` answers in well under a second
(tests/entrypoints/test_cli_help.py checks that torch is never imported for it).
"""
from __future__ import annotations

import argparse
import logging
import sys

from epdserve.commands import Command, Parser, add_commands

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
                         "build the native operators (csrc/) ahead of time"),
    "doctor": Command("epdserve.entrypoints.doctor_cli", "check this machine (and named servers) for epdserve"),
    "k8s": Command("epdserve.deploy.kube.cli", "Kubernetes manifests of a deployment mode (epdserve k8s render)"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (only its command built); None: every command built."""
    parser = Parser(
        prog="epdserve",
        description="EPD-disaggregated serving for vision-language models (Encode / Prefill / Decode).",
    )
    parser.add_argument("--log-level", default="INFO", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub, COMMANDS, argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
