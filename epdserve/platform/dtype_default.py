"""What `--dtype auto` means on each platform, and why: bf16 on an accelerator, and on a CPU whose
flags say it computes bf16 natively (AVX512-BF16 or AMX-BF16: x86's `avx512_bf16`, `amx_bf16` in
/proc/cpuinfo); fp32 on any other CPU, where bf16 matmuls are emulated and slower than fp32.
Imports no torch: launch resolves `auto` once, with this, and hands every instance the result.
"""
from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first processor's `flags` line); empty where there is none."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def auto_dtype(platform: str, flags: set[str] | None = None) -> tuple[str, str]:
    """(the dtype `auto` picks on `platform` ("cpu", "cuda", "npu"), why); `flags`: the CPU's
    (default: this machine's)."""
    if platform != "cpu":
        return "bfloat16", f"auto: bf16 on {platform}"
    native = [f for f in BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if native:
        return "bfloat16", f"auto: this CPU has {' and '.join(f.upper().replace('_', '-') for f in native)}"
    return "float32", "auto: this CPU has no AVX512-BF16 or AMX-BF16, so bf16 would be emulated"


def resolve_dtype(dtype: str | None, platform: str, flags: set[str] | None = None) -> tuple[str, str]:
    """(the dtype an engine runs, why): `dtype` as given, or `auto_dtype` for "auto" / None."""
    if dtype in (None, "auto"):
        return auto_dtype(platform, flags)
    return dtype, "--dtype"
