"""The `epdserve` command: one sub-command per module, each registering itself via `add_parser`.

Sub-commands are looked up from `COMMANDS` (module paths); each module exposes
`add_parser(subparsers)` which registers its parser and sets `func(args) -> int`, the common
part through `add_command` (its module docstring is its `--help` text).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = [
    "epdserve.model.demo",  # demo-model
    "epdserve.bench.cli",  # bench {offline,mm-store,kv-transfer,...}
    "epdserve.bench.profile",  # profile: per-stage cost on this device
    "epdserve.planner.cli",  # plan: predict each mode's SLO goodput from a profile, pick one
    "epdserve.entrypoints.instance_cli",  # instance: one E/P/D instance process
    "epdserve.entrypoints.launch",  # launch: a deployment mode (scheduler + instances)
    "epdserve.entrypoints.scheduler_cli",  # scheduler: the gRPC scheduler alone (cluster deployments)
    "epdserve.entrypoints.build_ops_cli",  # build-ops: the native paged-KV operators, ahead of time
    "epdserve.entrypoints.doctor_cli",  # doctor: what this machine has for epdserve, and what to fix
]


def add_command(subparsers, name: str, run, help: str, doc: str | None) -> argparse.ArgumentParser:
    """Register sub-command `name`: `help` is its line in the command list, `doc` (the module's
    docstring) its `--help` text, `run(args) -> int` what it does."""
    p = subparsers.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epdserve",
        description="EPD-disaggregated serving for vision-language models (Encode / Prefill / Decode).",
    )
    parser.add_argument("--log-level", default="INFO", help="python logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
