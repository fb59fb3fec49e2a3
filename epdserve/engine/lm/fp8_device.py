"""Whether a device runs the FP8 projections (engine/lm/fp8_linear.py; fp8_block_linear.py runs
rowwise scales too), decided at start-up.

The CPU build of torch runs `torch._scaled_mm` (float8_e4m3fn operands, tensorwise and rowwise fp32
scales, any float output dtype). On CUDA torch refuses it below compute capability 8.9:
`_scaled_mm_out_cuda` (aten/src/ATen/native/cuda/ScaledBlas.cpp, moved there from Blas.cpp in
torch 2.9) opens with `TORCH_CHECK(scaled_mm_arch_allowed(), "torch._scaled_mm is only supported on
CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+")`, and
`scaled_mm_arch_allowed` (ScaledBlasDeviceUtils.cpp) is `major >= 9 || (major == 8 && minor ==
9)`. Rowwise scales go further: cuBLAS on 9.x with cuBLAS ≥ 12.9, otherwise torch's CUTLASS
kernel, which `f8f8bf16_rowwise` (RowwiseScaledMM.cpp) has for 8.9, 9.x and 10.x only ("Rowwise
scaling is not currently supported on your device"), and only in a build with
BUILD_ROWWISE_FP8_KERNEL. Those lines were read from pytorch's main branch, not pinned to the
v2.11 tag the GPU image runs; so besides the capability rule, `check_fp8_device` runs one 16×16
`_scaled_mm` in each scale layout and output dtype the model will use on the device itself, and
refuses with torch's own message if it fails — a clear start-up error instead of a failure at the
first request.

`fp8_capability_refusal(name, capability)`: the refusal for a CUDA device below 8.9, else None.
"""
from __future__ import annotations

import torch

MIN_CAPABILITY = (8, 9)


def _fallback() -> str:
    from epdserve.engine.lm.linear import LINEAR_METHODS, METHOD_PLATFORMS

    others = [m for m in LINEAR_METHODS if m not in ("dense", "fp8") and "cuda" in METHOD_PLATFORMS[m]]
    return (f"a weight-only --quantization ({', '.join(others)})" if others else "the unquantized (bf16) checkpoint "
            "with --quantization left unset, or run on the CPU (torch's CPU _scaled_mm)")


def fp8_capability_refusal(name: str, capability: tuple[int, int]) -> str | None:
    """Why CUDA device `name` of `capability` cannot run FP8 (None: it can, by capability)."""
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    return (f"FP8 needs torch._scaled_mm, which torch runs on CUDA compute capability >= 8.9 only (Ada, Hopper, "
            f"Blackwell); {name} has {capability[0]}.{capability[1]}. Serve {_fallback()} instead")


def check_fp8_device(device: torch.device | str, layouts: set[str], dtype: torch.dtype) -> None:
    """ValueError when `device` cannot run `_scaled_mm` in each of `layouts` ("tensorwise",
    "rowwise") with `dtype` output (module docstring). Nothing to check for no layout."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        why = fp8_capability_refusal(name, torch.cuda.get_device_capability(device))
        if why:
            raise ValueError(why)
    elif device.type != "cpu":
        raise ValueError(f"FP8 projections run on CPU and CUDA only, not on {device.type}")
    for layout in sorted(layouts):
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        sa, sb = (one.expand(16, 1).contiguous(), one.expand(1, 16).contiguous()) if layout == "rowwise" else (one, one)
        try:
            out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=dtype)
        except RuntimeError as e:
            raise ValueError(f"this device ({device}) cannot run FP8 with {layout} scales and {dtype} output: "
                             f"torch._scaled_mm says {str(e).splitlines()[0]!r}. Serve {_fallback()} instead") from None
        if not bool((out.float() == 16).all()):
            raise ValueError(f"torch._scaled_mm on {device} ({layout}, {dtype}) returned a wrong product")
