"""A torch JIT lock file left by a killed process (`torch.utils.file_baton.FileBaton`) must not
hang the next process that loads the native operators (epdserve/ops/native_build.py): a stamped
build loads with no lock, and the build lock (`fcntl.flock`) dies with its holder."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from epdserve.ops.native_build import _build_lock, build_and_load, cache_root

LOAD = "from epdserve.ops.native_build import build_and_load; print(build_and_load())"


def test_a_stale_torch_lock_file_does_not_hang_a_cached_load(tmp_path):
    built = build_and_load()
    cache = tmp_path / "cache"
    copy = cache / built.relative_to(cache_root())
    shutil.copytree(built, copy)
    (copy / "lock").touch()  # what a process SIGKILLed inside torch's load() leaves
    env = dict(os.environ, EPDSERVE_OPS_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(copy)


def test_the_build_lock_is_released_when_its_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, pathlib; from epdserve.ops.native_build import _build_lock\n"
         f"with _build_lock(pathlib.Path({str(tmp_path)!r})):\n"
         "    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    (tmp_path / "lock").touch()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    with _build_lock(tmp_path):  # would block forever if the dead holder still held it
        assert not (tmp_path / "lock").exists()
