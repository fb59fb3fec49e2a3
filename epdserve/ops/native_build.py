"""Building the csrc/ operators: torch's C++-extension JIT (ninja), cached per torch version and
source hash, on first use or ahead of time (`epdserve build-ops`).

The library is built against the torch that is installed (an Ascend user's own torch included),
for the CPU it is built on (`-march=native`: build where it runs, or in the image that runs it),
with OpenMP so that `at::parallel_for` splits work over the calling thread's torch threads
(torch's own libgomp is the one loaded). Loading it registers `torch.ops.epdserve.*`.
Cache: `$EPDSERVE_OPS_CACHE`, else `~/.cache/epdserve/ops`, one folder per torch version and
source hash, so a changed source or another torch never reuses a stale build. A build that is not
cached says so on stderr while it runs (`build_progress.BuildProgress`); a cached one is silent.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path

import torch

from epdserve.ops.build_progress import BuildProgress

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-DNDEBUG")
LDFLAGS = ("-fopenmp",)


def csrc_dir() -> Path:
    """csrc/ of the source tree (editable install) or beside the installed package."""
    here = Path(__file__).resolve().parent.parent
    for cand in (here.parent / "csrc", here / "csrc"):
        if (cand / "registration.cpp").is_file():
            return cand
    raise FileNotFoundError(f"epdserve's csrc/ is not beside {here}: native operators cannot be built")


def sources() -> list[Path]:
    """The C++ this platform builds: the schemas and the CPU kernels (csrc/npu/ needs CANN)."""
    root = csrc_dir()
    return [root / "registration.cpp", *sorted((root / "cpu").glob("*.cpp"))]


def build_key(paths: list[Path]) -> str:
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("EPDSERVE_OPS_CACHE") or Path.home() / ".cache" / "epdserve" / "ops")


def build_dir(key: str) -> Path:
    """Where the library built from sources with `key` lives, for the installed torch."""
    return cache_root() / f"torch-{torch.__version__}" / f"epdserve_ops_{key}"


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; an un-activated venv's pip-installed ninja is not on it."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # torch's own error ("Ninja is required ...") then says what is missing
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


@lru_cache(maxsize=None)  # a process loads the library once; torch.ops registration is process-wide
def build_and_load(verbose: bool = False) -> Path:
    """Build (or reuse the cached build of) the operator library and load it; returns its folder.

    Raises whatever the compiler or loader raised (the caller decides whether to fall back)."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    paths = sources()
    folder = build_dir(build_key(paths))
    folder.mkdir(parents=True, exist_ok=True)
    cached = any(folder.glob("*.so"))
    with contextlib.nullcontext() if cached or verbose else BuildProgress(folder / "build.log"):
        load(name=folder.name, sources=[str(p) for p in paths], extra_cflags=list(CFLAGS),
             extra_ldflags=list(LDFLAGS), build_directory=str(folder), is_python_module=False, verbose=verbose)
    return folder
