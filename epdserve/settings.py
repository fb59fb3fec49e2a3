"""Settings dataclasses whose fields make the command-line flags (vLLM's `EngineArgs` pattern).

A field declared with `setting(...)` carries its flag, help, choices and unit conversion; from
that one declaration:

- `add_flags(parser, cls)` adds the flags (defaults and help from the field);
- `from_flags(cls, namespace)` builds the dataclass from parsed flags;
- `forward_argv(cls, names, values)` writes the same flags for a child process (launch → instance);
- `same_as(cls, name)` declares a field of another settings class as a copy of this one (the
  instance's `block_size` is the engine's), `shared_values(src, cls)` reads those copies back;
- `check_settings(obj)` (called from each class's `__post_init__`) checks every field against its
  declared `check` bound and `choices`, so a copy made with `same_as` is checked as its original;
- a setting declared with `env="EPDSERVE_..."` takes its value from that environment variable when
  it is not given (None): `read_env(obj)` (from `__post_init__`, before the checks) fills it in,
  typed as the field, `env_value(cls, name)` reads it alone; nothing else reads the variable.

A flag's value is in the flag's unit (`--kv-cache-mb 256`); `to_field` turns it into the field's
(`256 << 20` bytes), `from_field` back. A `negate` flag is a store_true that sets a True-by-default
field to False (`--no-core-split`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import MISSING
from typing import Any, Callable

_KEY = "epdserve_setting"


@dataclasses.dataclass(frozen=True)
class Setting:
    help: str
    flag: str | None = None  # default: --<field name with dashes>
    choices: tuple | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None  # default: from the field's annotation
    to_field: Callable[[Any], Any] | None = None
    from_field: Callable[[Any], Any] | None = None
    negate: str | None = None  # a store_true flag that turns this True-by-default field False
    required: bool = False
    action: type | str | None = None  # an argparse Action class taking one value (e.g. commands.FlagsArg), or "append"
    check: tuple[str, float] | None = None  # a bound on the value: (">", 0) or (">=", 1); None values pass
    env: str | None = None  # an environment variable (EPDSERVE_...) giving the value when it is not given


def setting(default: Any = MISSING, *, help: str, default_factory: Any = MISSING, **kw) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    meta = {_KEY: Setting(help=help, **kw)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def same_as(cls: type, name: str, default: Any = MISSING, help: str | None = None) -> Any:
    """A field that is `cls.name` again (same flag, choices, check and default), optionally with its
    own default or help (what the setting does in this command; the flag and its meaning stay)."""
    f = _field(cls, name)
    if default is MISSING:
        default = f.default
    meta = {**f.metadata, "epdserve_same_as": (cls, name)}
    if help is not None and _KEY in meta:
        meta[_KEY] = dataclasses.replace(meta[_KEY], help=help)
    if default is MISSING and f.default_factory is not MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_CHECKS = {">": lambda v, b: v > b, ">=": lambda v, b: v >= b}


def check_settings(obj: Any) -> None:
    """Raise ValueError for the first setting of `obj` outside its declared `check` or `choices`
    ("max_num_seqs must be >= 1, got 0"); a None value passes (not set)."""
    for f, s in settings_of(type(obj)):
        v = getattr(obj, f.name)
        if v is None:
            continue
        if s.choices and not s.action and v not in s.choices:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, s.choices))}, got {v!r}")
        if s.check and not _CHECKS[s.check[0]](v, s.check[1]):
            raise ValueError(f"{f.name} must be {s.check[0]} {s.check[1]:g}, got {v}")


def read_env(obj: Any) -> None:
    """Fill each setting of `obj` that is not given (None) and declares an `env` variable from that
    variable, when it is set (see `env_value`)."""
    for f, s in settings_of(type(obj)):
        if s.env and getattr(obj, f.name) is None:
            v = env_value(type(obj), f.name)
            if v is not None:
                object.__setattr__(obj, f.name, v)  # frozen settings classes too


def env_value(cls: type, name: str) -> Any:
    """The value the environment gives setting `name` of `cls` (its declared `env` variable), typed
    as the field (a choice lower-cased); None when the variable is unset or empty. Raises
    ValueError naming the variable for a value outside the setting's choices."""
    f, s = next((f, s) for f, s in settings_of(cls) if f.name == name)
    raw = os.environ.get(s.env or "", "").strip()
    if not raw:
        return None
    v = (s.type or _scalar(setting_types(cls)[f.name]))(raw)
    if s.choices:
        v = v.lower() if isinstance(v, str) else v
        if v not in s.choices:
            raise ValueError(f"{s.env} must be one of {', '.join(map(str, s.choices))}, got {raw!r}")
    return v


def shared_values(src: Any, cls: type) -> dict[str, Any]:
    """{field: value} of `src`'s fields declared `same_as(cls, ...)`: what `src` hands to a `cls`."""
    out = {}
    for f in dataclasses.fields(src):
        owner = f.metadata.get("epdserve_same_as")
        if owner and owner[0] is cls:
            out[owner[1]] = getattr(src, f.name)
    return out


def setting_types(cls: type) -> dict[str, Any]:
    """{name: type} of `cls`'s settings, each annotation resolved in its own class's module. Only
    the settings' annotations are resolved: the class's other fields may name types their module
    imports only for type checkers (a torch type, where `--help` must not import torch)."""
    names = {f.name for f, _ in settings_of(cls)}
    out: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        own = {n: a for n, a in vars(base).get("__annotations__", {}).items() if n in names}
        if own:
            out.update(typing.get_type_hints(type(base.__name__, (), {"__annotations__": own, "__module__": base.__module__})))
    return out


def settings_of(cls: type) -> list[tuple[dataclasses.Field, Setting]]:
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def flag_name(f: dataclasses.Field, s: Setting) -> str:
    return s.negate or s.flag or "--" + f.name.replace("_", "-")


def dest(f: dataclasses.Field, s: Setting) -> str:
    return flag_name(f, s).lstrip("-").replace("-", "_")


def add_flags(parser, cls: type, names: typing.Iterable[str] | None = None, unset_default: bool = False) -> None:
    """Add the flags of `cls`'s settings (all, or `names` in that order) to `parser` (or a group).
    `unset_default`: every default is None ("not given"), for a caller that merges other sources."""
    hints = setting_types(cls)
    table = {f.name: (f, s) for f, s in settings_of(cls)}
    for name in names or table:
        f, s = table[name]
        kw: dict[str, Any] = {"help": _help(f, s), "dest": dest(f, s)}
        if s.action:
            kw.update(action=s.action, default=None if unset_default else _flag_default(f, s))
            if s.metavar:
                kw["metavar"] = s.metavar
        elif s.negate or hints[f.name] is bool:
            kw.update(action="store_true", default=None if unset_default else False)
        else:
            default = _flag_default(f, s)
            kw.update(type=s.type or _scalar(hints[f.name]), default=None if unset_default else default)
            if s.choices:
                kw["choices"] = s.choices
            if s.metavar:
                kw["metavar"] = s.metavar
            if s.required and not unset_default:
                kw.update(required=True, default=None)
        parser.add_argument(flag_name(f, s), **kw)


def from_flags(cls: type, ns: argparse.Namespace, **values) -> Any:
    """`cls` from parsed flags (its settings the command offers), plus `values` for its other fields."""
    for f, s in settings_of(cls):
        if not hasattr(ns, dest(f, s)):
            continue  # a setting this command does not offer: the field's default
        v = getattr(ns, dest(f, s))
        if s.negate:
            v = not v
        elif v is not None and s.to_field:
            v = s.to_field(v)
        if v is not None or f.default is None:
            values[f.name] = v
    return cls(**values)


def forward_argv(cls: type, values: dict[str, Any], names: typing.Iterable[str]) -> list[str]:
    """The flags of `cls`'s settings `names` for a child's command line, from `values` keyed by
    the flags' dests (in the flags' units); None means not given, so the child's default applies."""
    table = {f.name: (f, s) for f, s in settings_of(cls)}
    argv: list[str] = []
    for name in names:
        f, s = table[name]
        v = values.get(dest(f, s))
        if v is None or v is False:
            continue
        if isinstance(v, (list, tuple)):
            for x in v:
                argv += [flag_name(f, s), str(x)]
        else:
            argv += [flag_name(f, s)] if v is True else [flag_name(f, s), str(v)]
    return argv


def flag_defaults(cls: type) -> dict[str, Any]:
    """{dest: default in the flag's unit} of `cls`'s settings (a default factory is called)."""
    out = {}
    for f, s in settings_of(cls):
        if f.default_factory is not MISSING:
            out[dest(f, s)] = f.default_factory()
        else:
            out[dest(f, s)] = _flag_default(f, s)
    return out


def flag_choices(cls: type) -> dict[str, tuple]:
    """{dest: choices} of `cls`'s settings that have a fixed set of values."""
    return {dest(f, s): tuple(s.choices) for f, s in settings_of(cls) if s.choices}


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def _flag_default(f: dataclasses.Field, s: Setting) -> Any:
    if s.negate:
        return False
    if f.default is MISSING:
        return None
    return s.from_field(f.default) if s.from_field and f.default is not None else f.default


def _help(f: dataclasses.Field, s: Setting) -> str:
    d = _flag_default(f, s)
    if s.negate or s.required or d is None or d == "" or isinstance(d, bool) or "default" in s.help:
        return s.help
    return f"{s.help} (default {d})"


def _scalar(hint: Any) -> Callable[[str], Any]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    t = args[0] if args else hint
    return t if t in (int, float, str) else str
