"""Reading a flag off a child process's argument list, as the child's argparse will read it."""
from __future__ import annotations


def last_flag(argv: list[str], name: str) -> str | None:
    """The value of flag `name` in `argv` as argparse reads it (`--x V` or `--x=V`; the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value
