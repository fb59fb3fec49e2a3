"""The demo checkpoints in the user's cache: built once by `model/demo.py`, then reused.

`cache_dir()` is `$EPDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/epdserve`, else `~/.cache/epdserve`
(as the generated protobuf tree's, proto_gen/codegen.py); a checkpoint lives in
`demo-models/<arch>-<size>-seed0-<DEMO_FORMAT>` under it. `cached_demo_model` returns it, building
it first when missing: into a fresh temporary folder beside it, then renamed into place, so two
processes that build at once (two launches) never see half a checkpoint — the second rename finds
the folder there and that process drops its own copy (the same seed gives the same files).

`epdserve launch` without `--model` serves `DEMO` (a tiny random-weight Qwen2-VL: its answers are
noise, its greedy outputs still equal transformers'); the benchmarks use larger sizes.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_FORMAT = "v2"  # v2: with video_preprocessor_config.json (video input); a newer format is built afresh
DEMO = ("qwen2_vl", "tiny")  # launch's built-in checkpoint: (arch, size)


def cache_dir() -> Path:
    """The folder epdserve caches built files in (see the module docstring)."""
    if os.environ.get("EPDSERVE_CACHE_DIR"):
        return Path(os.environ["EPDSERVE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "epdserve"
    return Path.home() / ".cache" / "epdserve"


def demo_model_path(arch: str, size: str) -> Path:
    return cache_dir() / "demo-models" / f"{arch}-{size}-seed0-{DEMO_FORMAT}"


def cached_demo_model(arch: str = DEMO[0], size: str = DEMO[1]) -> Path:
    """The `arch` / `size` demo checkpoint in the cache, built on first use (race-safe: see above)."""
    path = demo_model_path(arch, size)
    if _complete(path):
        return path
    from epdserve.model.demo import build_demo_model

    log.info("building the %s %s demo checkpoint (random weights) into %s, once", size, arch, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build_demo_model(tmp, arch=arch, size=size, seed=0)
        tmp.rename(path)  # atomic; fails when another process's rename came first
    except OSError:
        if not _complete(path):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after our rename; our copy when we lost the race
    return path


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
