"""What a fresh machine needs is declared: every third-party module that epdserve, its tests and its
benchmarks import comes from a distribution that setup.py names (in install_requires or an extra),
and CI's set-up commands are the README's."""
import ast
import importlib.metadata as md
import importlib.util
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# Modules whose distribution is declared but cannot be installed here (Ascend's torch_npu: the npu extras).
NOT_INSTALLABLE_HERE = {"torch_npu": "torch-npu"}
# Modules imported only by code that runs in a peer's own venv (vLLM's: epdserve/bench/peer_vllm.py
# builds it), never by epdserve's interpreter: not epdserve's dependencies.
PEER_ONLY = {"vllm": "epdserve/bench/offline_vs_vllm.py"}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> dict[str, str]:
    """Top-level third-party module -> one file importing it."""
    found: dict[str, str] = {}
    for folder in ("epdserve", "tests", "benchmarks", "scripts"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("epdserve", "tests", "benchmarks"):
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


def _declared() -> set[str]:
    """Distributions epdserve's metadata requires, in any extra (setup.py, as installed)."""
    return {_canon(Requirement(r).name) for r in md.requires("epdserve") or []}


def test_every_imported_module_is_declared():
    declared = _declared()
    dists = md.packages_distributions()
    missing = []
    for module, where in sorted(_imported_modules().items()):
        if PEER_ONLY.get(module) == where:
            continue
        names = dists.get(module) or [NOT_INSTALLABLE_HERE.get(module, module)]
        if not any(_canon(n) in declared for n in names):
            missing.append(f"{module} (imported by {where}; distribution {names}) is not in setup.py")
    assert not missing, "\n".join(missing)


def test_ci_runs_the_readmes_set_up_commands():
    spec = importlib.util.spec_from_file_location("readme_setup", REPO / ".ci" / "readme_setup.py")
    readme_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_setup)
    commands = readme_setup.setup_commands((REPO / "README.md").read_text())
    assert commands == ["pip install -r requirements-cpu.txt", "python -m pytest -q"]
    run = (REPO / ".ci" / "run").read_text()
    assert all(f"\n{c}\n" in run for c in commands)  # CI runs them as written
