"""`epdserve doctor`'s Ascend rows: driver ↔ CANN ↔ torch_npu against the table of
platform/npu_versions.py, and what the NPU core-limit API documents (issue 37 items 5, 6).

Versions are read as torch_npu reads them where it imports (`torch_npu.utils.get_cann_version`:
"CANN" and "DRIVER", torch_npu/npu/utils.py on v2.8.0-7.2.0, v2.9.0-7.3.0, v2.12.0-26.1.0; ""
before CANN 8.1.RC1, GetCANNInfo.cpp), else from the files (the toolkit's
ascend_toolkit_install.info, `<ASCEND_HOME>/driver/version.info`, as scripts/atlas_node.sh reads
them).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
from pathlib import Path

from epdserve.platform.npu_versions import check

ORDER = {"ok": 0, "warn": 1, "fail": 2}


def installed_versions(cann_from_files) -> tuple[str, str, str]:
    """(torch_npu, CANN, driver), "" where not found."""
    try:
        torch_npu = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        torch_npu = ""
    cann = driver = ""
    try:
        get = importlib.import_module("torch_npu").utils.get_cann_version
        cann, driver = str(get("CANN") or ""), str(get("DRIVER") or "")
    except Exception:  # not importable here: the torch_npu row says why
        pass
    if not cann:
        found = cann_from_files()
        cann = found[0] if found else ""
    if not driver:
        info = Path(os.environ.get("ASCEND_HOME", "/usr/local/Ascend")) / "driver" / "version.info"
        try:
            driver = next((line.partition("=")[2].strip() for line in info.read_text().splitlines()
                           if line.startswith("Version=")), "")
        except OSError:
            driver = ""
    return torch_npu, cann, driver


def versions_row(check_cls, status_cls, cann_from_files):
    """One doctor row: the worst finding's status, every finding's detail, the worst one's fix."""
    torch_npu, cann, driver = installed_versions(cann_from_files)
    findings = check(torch_npu or None, cann or None, driver or None)
    if not findings:
        return check_cls("NPU versions", status_cls.OK, "torch_npu, CANN or driver not found: nothing to match")
    worst = max(findings, key=lambda f: ORDER[f.status])
    detail = "; ".join(f.detail for f in findings)
    return check_cls("NPU versions", status_cls(worst.status), detail, worst.fix)


def core_limits_row(check_cls, status_cls):
    return check_cls("NPU core limits", status_cls.OK,
                     "off unless --npu-core-limits: torch.npu.set_stream_limit / set_device_limit are documented for "
                     "Atlas A2 / A3 training products only (op-plugin torch_npu-set_stream_limit.md), not the 800I A2; "
                     "verify with `epdserve bench colocation --device npu` before opting in")
