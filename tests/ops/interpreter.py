"""Running a Triton cases script on this CPU through Triton's interpreter, for the kernel tests
(test_triton_decode.py, test_triton_layer.py, test_cuda_quant_linear.py): a subprocess with
TRITON_INTERPRET=1 (Triton reads it when a kernel is decorated, so it must be set before the import)
and this checkout first on the path (not an installed epdserve); its JSON lines are the rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def interpreted_rows(cases: Path, timeout: float = 300) -> list[dict]:
    """The `{...}` lines `cases` prints, run under Triton's interpreter; AssertionError with its
    stderr when it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(cases)], env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
