"""The device's wheel list (scripts/device_wheels.txt, issue 52 item 5) carries what CUDA's
operators need on the GPU image: Triton at the image's torch 2.11.0 pin, xgrammar at setup.py's
floor with its apache-tvm-ffi; every line an exact pin (`pip install --no-deps` takes no ranges);
the fetch script parses."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    lines = [x.strip() for x in (REPO / "scripts" / "device_wheels.txt").read_text().splitlines()]
    lines = [x for x in lines if x and not x.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", x) for x in lines), lines
    pins = dict(x.split("==") for x in lines)
    assert len(pins) == len(lines)  # no name twice
    return {k.lower().replace("_", "-"): v for k, v in pins.items()}


def test_the_list_carries_triton_at_torch_2_11s_pin_and_xgrammar_at_setups_floor():
    pins = _pins()
    assert pins["triton"] == "3.6.0"  # torch-2.11.0 manylinux METADATA: triton==3.6.0; platform_system == "Linux"
    floor = re.search(r'"xgrammar>=([0-9.]+)"', (REPO / "setup.py").read_text()).group(1)
    assert tuple(map(int, pins["xgrammar"].split("."))) >= tuple(map(int, floor.split(".")))
    assert "apache-tvm-ffi" in pins and "transformers" in pins and "torch" not in pins  # the image's torch stays


def test_the_fetch_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "fetch_device_wheels.sh")], check=True)
