"""The cached demo checkpoint (model/demo_cache.py): where it goes (EPDSERVE_CACHE_DIR over
XDG_CACHE_HOME over ~/.cache), built once and reused, and two processes building it at once end
with one complete checkpoint and no temporary folder left."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

from epdserve.model import demo_cache
from epdserve.model.demo_cache import cache_dir, cached_demo_model


def test_the_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("EPDSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "epdserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "epdserve"
    monkeypatch.setenv("EPDSERVE_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


def _build(cache: str, out: multiprocessing.Queue) -> None:
    import os

    os.environ["EPDSERVE_CACHE_DIR"] = cache
    out.put(str(cached_demo_model()))


def test_two_builders_at_once_leave_one_complete_checkpoint_reused_after(tmp_path, monkeypatch):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_build, args=(str(tmp_path), out)) for _ in range(2)]
    for p in procs:
        p.start()
    paths = {out.get(timeout=300) for _ in procs}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (path,) = paths
    path = Path(path)
    assert path.parent == tmp_path / "demo-models" and path.name.startswith("qwen2_vl-tiny-seed0-")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary folder left
    assert (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def refuse(*a, **k):
        raise AssertionError("a complete cached checkpoint was built again")

    monkeypatch.setenv("EPDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("epdserve.model.demo.build_demo_model", refuse)
    assert cached_demo_model() == path == demo_cache.demo_model_path(*demo_cache.DEMO)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
