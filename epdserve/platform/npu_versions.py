"""Driver ↔ CANN ↔ torch_npu on an Ascend host: the table epdserve checks them against, and the
check, for `epdserve doctor` and `scripts/atlas_node.sh preflight` (`python -m
epdserve.platform.npu_versions --torch-npu V --cann V --driver V`: one line per finding, exit 1 on
a failure).

Sources:
- torch_npu build → CANN: Ascend/pytorch COMPATIBILITY.en.md (master b48e648, 2026-08-20), the
  rows of the torch versions epdserve's extras pin and their neighbours. A build runs on the CANN
  line it is built for (major.minor: vllm-ascend v0.13.0 runs torch-npu 2.8.0, the 8.3.RC1
  build, on CANN 8.3.rc2); another line is a failure, the fix naming the build for the installed
  CANN or the CANN for the installed build.
- CANN 8.3.RC1: its attention kernel was reported refusing our call (TND + paged KV; vllm-ascend
  issues #4373, #8045): a warning here; the engine's start-up check decides
  (ops/npu_attention_check.py).
- the driver: torch_npu reads it (`torch_npu.utils.get_cann_version("DRIVER")`, GetCANNInfo.cpp,
  empty before CANN 8.1.RC1) and gates features on it (AclInterface.cpp, v2.12.0-26.1.0):
  driver >= 25.5.0 with CANN >= 8.5.0 for `aclrtPointerGetAttributes`, which tells pinned host
  memory from pageable memory in a non_blocking copy (`process_non_blocking_copy`; below it
  torch_npu falls back to its own allocator's record), and >= 25.0.RC1 for
  `aclrtMemcpyAsyncWithCondition`. Below these: a warning.
- driver (Ascend HDK) ↔ CANN: the compatibility tables of CANN's release notes. CANN 9.1.0
  Release Notes, "CANN and Ascend HDK Version Compatibility" (hiascend.com
  document/detail/en/CANNCommunityEdition/910/softwareinst/releasenote/9.1.0/release-notes.md;
  the same table in gitcode.com/cann/release-management 9.1.0/release-notes.md): CANN 8.5.2 and
  9.0.X run on HDK 25.0.X, 25.2.X, 25.3.X, 25.5.X, 26.0.RC1/25.7.RC1 and 26.1.0; 9.1.X on all of
  them but 25.0.X. CANN 8.5.0 "Mapping Between CANN and Driver Versions" (hiascend.com
  document/detail/en/canncommercial/850/releasenote/releasenote_0000.html): HDK 25.5.X, 25.3.X,
  25.2.X, 25.0.X. A driver line older than the oldest listed is a failure; newer than the newest
  listed, a warning. The Atlas 800I A2 needs HDK 24.1.RC1 or later with CANN 8.0.RC1 or later
  (Ascend Index SDK installation guide, hiascend.com document/detail/en/mindsdk/730/Indexn/
  indexug/mxindexfrug_0009.html): below it, a failure for every CANN. For CANN lines before 8.5
  (8.3) no release-note table was found: said, not checked.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

# torch_npu package version -> the CANN it is built for (COMPATIBILITY.en.md)
TORCH_NPU_CANN = {
    "2.12.0": "9.1.0", "2.11.0": "9.1.0", "2.10.0.post4": "9.1.0", "2.9.0.post6": "9.1.0", "2.7.1.post8": "9.1.0",
    "2.9.0.post2": "9.0.0", "2.8.0.post4": "9.0.0", "2.7.1.post4": "9.0.0",
    "2.9.0": "8.5.0", "2.8.0.post2": "8.5.0", "2.7.1.post2": "8.5.0",
    "2.8.0": "8.3.RC1", "2.7.1": "8.3.RC1",
}
REPORTED_REFUSING_TND_PAGED = ("8.3.RC1",)  # vllm-ascend #4373 / #8045
DRIVER_POINTER_ATTRIBUTES = "25.5.0"  # AclInterface.cpp AclrtPointerGetAttributesExist (with CANN runtime >= 8.5.0)
DRIVER_MEMCPY_CONDITION = "25.0.RC1"  # AclInterface.cpp AclrtMemcpyAsyncWithConditionExist
# CANN line -> the oldest Ascend HDK (driver) line its release notes list (module docstring)
CANN_OLDEST_DRIVER = {"9.1": "25.2", "9.0": "25.0", "8.5": "25.0"}
NEWEST_LISTED_DRIVER = "26.1"  # the newest HDK line in CANN 9.1.0's compatibility table
A2_OLDEST_DRIVER = "24.1.RC1"  # Atlas 800I A2: HDK 24.1.RC1 or later


@dataclass(frozen=True)
class Finding:
    status: str  # "ok", "warn" or "fail"
    detail: str
    fix: str = ""


def cann_line(version: str) -> str:
    """"8.3.RC1" / "8.3.rc2" -> "8.3"; "9.1.0" -> "9.1"."""
    return ".".join(version.strip().split(".")[:2])


def line_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in cann_line(version).split(".") if x.isdigit())


def driver_key(version: str) -> tuple:
    """Comparable driver version: major, minor, then a release (digits) above an RC of the same
    minor (torch_npu GetCANNInfo.cpp DriverVersionToNum orders RC below releases)."""
    parts = version.strip().lower().split(".")
    nums = [int(re.sub(r"\D", "", p) or 0) for p in parts[:2]] + [0, 0]
    third = parts[2] if len(parts) > 2 else "0"
    rank = (0, int(third[2:] or 0)) if third.startswith("rc") else (1, int(re.sub(r"\D", "", third) or 0))
    return (nums[0], nums[1], *rank)


def check(torch_npu: str | None, cann: str | None, driver: str | None) -> list[Finding]:
    """Findings for the installed versions (None or "": not found)."""
    out: list[Finding] = []
    built_for = TORCH_NPU_CANN.get(torch_npu or "")
    if torch_npu and cann:
        if built_for is None:
            out.append(Finding("warn", f"torch_npu {torch_npu} is not in the table (Ascend/pytorch COMPATIBILITY.en.md)",
                               "use a torch_npu the README's Ascend table lists"))
        elif cann_line(built_for) != cann_line(cann):
            same = [v for v, c in TORCH_NPU_CANN.items() if cann_line(c) == cann_line(cann)
                    and v.split(".post")[0] == torch_npu.split(".post")[0]]
            fix = (f"pip install 'torch-npu=={same[0]}' (the build for CANN {cann})" if same
                   else f"install CANN {built_for}, the one torch_npu {torch_npu} is built for")
            out.append(Finding("fail", f"torch_npu {torch_npu} is built for CANN {built_for}, this host has CANN {cann}",
                               fix))
        else:
            out.append(Finding("ok", f"torch_npu {torch_npu} is built for CANN {built_for}; CANN {cann} installed"))
    if cann and cann.upper() in REPORTED_REFUSING_TND_PAGED:
        out.append(Finding("warn", f"CANN {cann}'s attention kernel was reported refusing TND with a paged KV cache "
                           "(vllm-ascend #4373, #8045); the engine checks at start-up",
                           "CANN 8.3.RC2+ of the same line, or the [npu] / [npu-cann85] extra with its CANN"))
    if driver:
        out.extend(_driver_against_cann(driver, cann))
        if cann and line_key(cann) >= (8, 5) and driver_key(driver) < driver_key(DRIVER_POINTER_ATTRIBUTES):
            out.append(Finding("warn", f"driver {driver} < {DRIVER_POINTER_ATTRIBUTES}: torch_npu cannot ask the runtime "
                               "whether host memory is pinned (aclrtPointerGetAttributes, AclInterface.cpp)",
                               f"upgrade the Ascend HDK driver to {DRIVER_POINTER_ATTRIBUTES} or later"))
        elif driver_key(driver) < driver_key(DRIVER_MEMCPY_CONDITION):
            out.append(Finding("warn", f"driver {driver} < {DRIVER_MEMCPY_CONDITION} (aclrtMemcpyAsyncWithCondition, "
                               "AclInterface.cpp)", f"upgrade the Ascend HDK driver to {DRIVER_MEMCPY_CONDITION} or later"))
        else:
            out.append(Finding("ok", f"driver {driver}"))
    return out


def _driver_against_cann(driver: str, cann: str | None) -> list[Finding]:
    """The driver (Ascend HDK) against the CANN release notes' compatibility tables."""
    line = line_key(driver)
    if driver_key(driver) < driver_key(A2_OLDEST_DRIVER):
        return [Finding("fail", f"driver {driver} is older than the Atlas 800I A2 supports (HDK {A2_OLDEST_DRIVER} or later)",
                        f"upgrade the Ascend HDK driver and firmware to {A2_OLDEST_DRIVER} or later")]
    if not cann:
        return []
    oldest = CANN_OLDEST_DRIVER.get(cann_line(cann))
    if oldest is None:
        return [Finding("warn", f"CANN {cann}: its driver pairing is not in epdserve's table (CANN 8.5+ release notes); "
                        f"driver {driver} not checked against it",
                        "check the CANN release notes' Ascend HDK table for this CANN")]
    if line < line_key(oldest):
        return [Finding("fail", f"driver {driver} is older than CANN {cann} runs on (HDK {oldest}.X or later: "
                        "CANN release notes' compatibility table)",
                        f"upgrade the Ascend HDK driver and firmware to {oldest}.X or later, or install a CANN the "
                        f"driver supports")]
    if line > line_key(NEWEST_LISTED_DRIVER):
        return [Finding("warn", f"driver {driver} is newer than CANN {cann}'s release notes list (up to HDK "
                        f"{NEWEST_LISTED_DRIVER}.X)", "check the CANN release notes for this driver")]
    return [Finding("ok", f"driver {driver} is in CANN {cann}'s compatibility table (HDK {oldest}.X or later)")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epdserve.platform.npu_versions", description=__doc__.split("\n")[0])
    p.add_argument("--torch-npu", default="")
    p.add_argument("--cann", default="")
    p.add_argument("--driver", default="")
    a = p.parse_args(argv)
    findings = check(a.torch_npu or None, a.cann or None, a.driver or None)
    for f in findings:
        print(f"{f.status}: {f.detail}" + (f" -- fix: {f.fix}" if f.fix else ""))
    return 1 if any(f.status == "fail" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
