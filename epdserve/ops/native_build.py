"""Building the csrc/ operators: torch's C++-extension JIT (ninja), cached per torch version and
source hash, on first use or ahead of time (`epdserve build-ops`).

The library is built against the torch that is installed (an Ascend user's own torch included),
for the CPU it is built on (`-march=native`: build where it runs, or in the image that runs it),
with OpenMP so that `at::parallel_for` splits work over the calling thread's torch threads
(torch's own libgomp is the one loaded). Loading it registers `torch.ops.epdserve.*`.
Cache: `$EPDSERVE_OPS_CACHE`, else `~/.cache/epdserve/ops`, one folder per torch version and
source hash, so a changed source or another torch never reuses a stale build. A build that is not
cached says so on stderr while it runs (`build_progress.BuildProgress`); a cached one is silent.

Concurrency and killed processes: torch's JIT guards a build with a lock *file*
(`torch.utils.file_baton.FileBaton`, created with O_EXCL and removed in a `finally`); a process
SIGKILLed while holding it (an instance killed as it starts: every `load()` takes it, cached or
not, to run ninja) leaves the file behind, and every later `load()` of that folder then polls for
it forever. So a finished build is marked by a stamp (`built`, written after the library loaded)
and loaded straight from its `.so` with no lock at all; a build runs under an `fcntl.flock` on
`build.flock` (the kernel drops it when its holder dies), which also makes a left-over torch lock
file provably stale: whoever holds the flock removes it before calling torch.
"""
from __future__ import annotations

import contextlib
import fcntl
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


STAMP = "built"


@lru_cache(maxsize=None)  # a process loads the library once; torch.ops registration is process-wide
def build_and_load(verbose: bool = False) -> Path:
    """Build (or reuse the cached build of) the operator library and load it; returns its folder.

    Raises whatever the compiler or loader raised (the caller decides whether to fall back)."""
    paths = sources()
    folder = build_dir(build_key(paths))
    folder.mkdir(parents=True, exist_ok=True)
    if not _load_built(folder):
        with _build_lock(folder):
            if not _load_built(folder):  # another process may have built it while this one waited
                _build(folder, paths, verbose)
    return folder


def _load_built(folder: Path) -> bool:
    """Load the library a finished build left in `folder` (no lock, no ninja); False if none."""
    try:
        so = (folder / STAMP).read_text().strip()
    except FileNotFoundError:
        return False
    torch.ops.load_library(str(folder / so))
    return True


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One builder per folder across processes; released by the kernel if its holder is killed.
    Holding it, torch's lock file can only be a dead process's: it is removed."""
    with open(folder / "build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
        (folder / "lock").unlink(missing_ok=True)
        yield


def _build(folder: Path, paths: list[Path], verbose: bool) -> None:
    """Run torch's JIT build into `folder`, load the result, then stamp the folder as built."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    cached = any(folder.glob("*.so"))  # an older build without a stamp: ninja only checks it
    with contextlib.nullcontext() if cached or verbose else BuildProgress(folder / "build.log"):
        load(name=folder.name, sources=[str(p) for p in paths], extra_cflags=list(CFLAGS),
             extra_ldflags=list(LDFLAGS), build_directory=str(folder), is_python_module=False, verbose=verbose)
    built = max(folder.glob(f"{folder.name}*.so"), key=lambda p: p.stat().st_mtime)
    tmp = folder / f"{STAMP}.{os.getpid()}"
    tmp.write_text(built.name + "\n")
    tmp.replace(folder / STAMP)  # atomic: a reader sees no stamp or a whole one
