"""The settings every part shares are declared once (epdserve/settings.py, epdserve/slo.py): the SLO
pair, the KV block size, the KV cache size, the device and the KV transfer's settings (`--kv-*`,
`KVTransferConfig`'s) each have exactly one `setting(...)`
declaration in the package, no hand-written flag; no setting anywhere gets a second default
(`same_as(..., default=X)`; `default=None`, "not given", is allowed),
and every command that offers one shows the same default in its `--help`."""
from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

from epdserve.engine.config import EngineConfig
from epdserve.entrypoints.cli import build_parser
from epdserve.settings import flag_defaults, flag_name, settings_of
from epdserve.slo import SLO
from epdserve.transfer.kv import KVTransferConfig

PACKAGE = Path(__file__).resolve().parents[1] / "epdserve"

# flag: (the class that declares it, the file it is declared in)
SHARED = {
    "--slo-ttft-ms": (SLO, "slo.py"),
    "--slo-tpot-ms": (SLO, "slo.py"),
    "--block-size": (EngineConfig, "engine/config.py"),
    "--kv-cache-mb": (EngineConfig, "engine/config.py"),
    "--device": (EngineConfig, "engine/config.py"),
    "--kv-timeout-s": (KVTransferConfig, "transfer/kv/config.py"),
    "--kv-connect-timeout-s": (KVTransferConfig, "transfer/kv/config.py"),
    "--kv-hop": (KVTransferConfig, "transfer/kv/config.py"),
    "--kv-pair-rebuilds": (KVTransferConfig, "transfer/kv/config.py"),
    "--kv-pair-rebuild-window-s": (KVTransferConfig, "transfer/kv/config.py"),
}
# the commands that offer each one (`epdserve ...` words; "benchmarks/x.py" for the scripts)
OFFERED = {
    "--slo-ttft-ms": ["launch", "scheduler", "plan", "bench serve", "benchmarks/vs_transformers_serve.py",
                      "benchmarks/multiturn.py"],
    "--slo-tpot-ms": ["launch", "scheduler", "instance", "plan", "bench serve", "benchmarks/vs_transformers_serve.py",
                      "benchmarks/multiturn.py"],
    "--block-size": ["launch", "instance", "bench kv-transfer"],
    "--kv-cache-mb": ["launch", "instance"],
    "--device": ["launch", "instance", "doctor", "profile", "bench device"],
    "--kv-timeout-s": ["instance"],
    "--kv-connect-timeout-s": ["instance"],
    "--kv-hop": ["launch", "instance", "bench device"],
    "--kv-pair-rebuilds": ["instance"],
    "--kv-pair-rebuild-window-s": ["instance"],
}
# `--device` flags that mean something else, with their own choices: which co-location to measure
# (CPU cores or NPU streams; CUDA has none) and the NPU first-run steps (an NPU tool)
OTHER_DEVICE_FLAGS = {"bench/colocation.py", "checks/npu/first_run.py"}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        if "proto_gen" not in path.parts:
            yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _kw(call: ast.Call, key: str):
    return next((k.value for k in call.keywords if k.arg == key), None)


def _declarations() -> dict[str, list[str]]:
    """flag -> the files whose `name: T = setting(...)` declares it."""
    found: dict[str, list[str]] = {}
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call) and _name(node.value) == "setting":
                flag = _kw(node.value, "flag")
                name = flag.value if isinstance(flag, ast.Constant) else "--" + node.target.id.replace("_", "-")
                found.setdefault(name, []).append(rel)
    return found


@pytest.mark.parametrize("flag", SHARED)
def test_each_shared_setting_is_declared_once(flag):
    cls, where = SHARED[flag]
    assert _declarations().get(flag) == [where]
    assert flag in [flag_name(f, s) for f, s in settings_of(cls)]


def test_no_command_writes_a_shared_flag_by_hand_or_gives_it_a_second_default():
    """No hand-written shared flag; no `same_as` anywhere gives its setting a default of its own."""
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            if _name(node) == "add_argument" and node.args and isinstance(node.args[0], ast.Constant):
                flag = node.args[0].value
                if flag in SHARED and not (flag == "--device" and rel in OTHER_DEVICE_FLAGS):
                    raise AssertionError(f"{rel}:{node.lineno} adds {flag} by hand; add_flags from its field")
            if _name(node) == "same_as" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                default = _kw(node, "default")  # None is "not given" (the k8s renderer passes nothing then)
                if default is not None and not (isinstance(default, ast.Constant) and default.value is None):
                    raise AssertionError(f"{rel}:{node.lineno} gives {node.args[1].value} a second default")


def test_the_launch_configs_do_not_restate_the_kv_cache_size():
    for path in sorted((PACKAGE.parent / "configs").glob("*.yaml")):
        assert "kv_cache" not in path.read_text(), path.name


def _help(words: str) -> str:
    if words.startswith("benchmarks/"):
        from epdserve.bench import multiturn_bench, vs_peer

        module = {"benchmarks/vs_transformers_serve.py": vs_peer, "benchmarks/multiturn.py": multiturn_bench}[words]
        return module.parser().format_help()
    argv = [*words.split(), "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    return out.getvalue()


def _flag_help(text: str, flag: str) -> str:
    """The help text of `flag` in a `--help` output (its line and continuation lines, one space each)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s+{re.escape(flag)}(\s|,|$)", line))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * 6):
            break
        block.append(line)
    return " ".join(" ".join(block).split())


def _default_shown(help_text: str) -> str:
    m = re.search(r"\(default:? ([^)]*)\)|default: ([^);]*)", help_text)
    assert m, help_text
    return " ".join((m.group(1) or m.group(2)).split())


@pytest.mark.parametrize("flag", SHARED)
def test_every_command_shows_the_same_default(flag):
    cls, _ = SHARED[flag]
    field = next(f for f, s in settings_of(cls) if flag_name(f, s) == flag)
    default = flag_defaults(cls)[flag.lstrip("-").replace("-", "_")]
    shown = {words: _default_shown(_flag_help(_help(words), flag)) for words in OFFERED[flag]}
    assert len(set(shown.values())) == 1, shown
    if default is not None:
        assert set(shown.values()) == {str(default)}, (field.name, shown)


def _declared_envs() -> set[str]:
    """The environment variables `setting(..., env=...)` declarations read."""
    envs = set()
    for _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node) == "setting":
                env = _kw(node, "env")
                if isinstance(env, ast.Constant):
                    envs.add(env.value)
    return envs


def test_a_setting_from_the_environment_is_read_only_through_its_declaration():
    """`EngineConfig.ops` declares EPDSERVE_OPS: no module reads such a variable by hand
    (os.environ.get / os.getenv / os.environ[...]); `settings.read_env` / `env_value` do."""
    envs = _declared_envs()
    assert "EPDSERVE_OPS" in envs
    for rel, tree in _sources():
        for node in ast.walk(tree):
            key = None
            if isinstance(node, ast.Call) and _name(node) in ("get", "getenv", "pop") and node.args:
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "environ":
                key = node.slice
            if isinstance(key, ast.Constant) and key.value in envs:
                raise AssertionError(f"{rel}:{node.lineno} reads {key.value} by hand; read the setting declaring it")
