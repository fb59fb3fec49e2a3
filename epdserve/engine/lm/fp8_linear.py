"""FP8 projections of the linear-layer contract (engine/lm/linear.py): float8_e4m3fn weights with
fp32 scales, the activations quantized to float8_e4m3fn at run time, one `torch._scaled_mm`.

Built two ways:
- from a checkpoint's own FP8 tensors (`Fp8Linear.prequantized`; compressed-tensors' W8A8-FP8,
  engine/lm/fp8_checkpoint.py reads its description, engine/lm/fp8_parts.py its tensors): each
  part's weights q [out_i, in] and its scale, one per tensor ([1]) or one per output channel
  ([out_i]); the weights stand for q · scale. The activations as the checkpoint says: per token
  at run time ("token"), or per tensor with the checkpoint's calibrated `input_scale` ("static").
  Fused parts (QKV's three, gate-up's two) with static activations quantize their one input
  with the largest of their input scales, as vLLM does (`CompressedTensorsW8A8Fp8.
  process_weights_after_loading`: `layer.input_scale.max()`), so the projection is one GEMM.
  Per-tensor weight scales that differ between fused parts are held per output row (exact); vLLM instead re-quantizes the parts to their largest scale
  (`process_fp8_weight_tensor_strategy`), which rounds the weights again.
- from float weights at load (`--quantization fp8`, as vLLM's `Fp8LinearMethod` quantizes an
  unquantized checkpoint): one scale for the fused projection's weights, max|w| / 448, and
  activations per token at run time (vLLM's default there is one scale per call; per token keeps
  a request's output independent of the requests batched with it).

Quantizing (`quantize_fp8`): q = (v / scale) clamped to ±448 (e4m3's largest finite value), cast
to float8_e4m3fn (round to nearest even: 3 mantissa bits, so each value within 2⁻⁴ of its own
magnitude, relative, in the normal range). A dynamic scale is max|v| / 448 over the token (the
weights at load: over the tensor), at least 1 / (448 · 512) — vLLM's
`dynamic_per_token_scaled_fp8_quant` floor — in fp32.

The kernel: `torch._scaled_mm(xq, q.t(), scale_a, scale_b, out_dtype=model dtype)` computes
(xq · scale_a) @ (q · scale_b)ᵀ with fp32 accumulation. Its scale layouts are "tensorwise" (both
scales one fp32 value) or "rowwise" (scale_a [tokens, 1], scale_b [1, out], both fp32 and
contiguous); torch refuses any mix (aten/src/ATen/native/cuda/ScaledBlas.cpp `get_joint_scaling`,
and the same on CPU). A projection runs tensorwise when its weights have one scale and its
activations are static, else rowwise (a per-tensor scale repeated). Bias, if any, is added
after in the model dtype (torch's bias argument takes bf16 / fp16 only). On CUDA the kernel needs
compute capability ≥ 8.9: engine/lm/fp8_device.py checks the device at start-up.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fusion import fuse, fuse_bias

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512)  # a dynamic scale's floor (an all-zero row)
ACTIVATIONS = ("token", "static")


def quantize_fp8(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn of `v` / `scale` (fp32, `scale` broadcast: one value or [rows, 1]), clamped to ±448."""
    return (v.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dynamic_scale(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """max|x| / 448 per row ([rows, 1]) or over the whole of `x` (one value), fp32, floored."""
    amax = x.float().abs().amax(dim=1, keepdim=True) if per_token else x.float().abs().amax()
    return amax.div_(FP8_MAX).clamp_(min=MIN_SCALE)


def dequantize_fp8(q: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights q [out, in] and their scales (one, or one per row) stand for, in `dtype`."""
    return (q.float() * row_scales.float().reshape(-1, 1)).to(dtype)


class Fp8Linear:
    """FP8 weights and activations, one `torch._scaled_mm` a call (see the module docstring)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        """`--quantization fp8`: the fused weights quantized with one scale, activations per token."""
        w, bias = fuse(weights, biases)
        scale = dynamic_scale(w, per_token=False)
        self._hold(quantize_fp8(w, scale), scale.reshape(1).expand(w.shape[0]), bias, "token", None)

    @classmethod
    def prequantized(cls, qs: list[torch.Tensor], scales: list[torch.Tensor], biases: list[torch.Tensor | None],
                     dtype: torch.dtype, activations: str, input_scales: list[float] | None = None) -> Fp8Linear:
        """The projection fusing a checkpoint's FP8 parts: each part's q [out_i, in] float8_e4m3fn and
        its weight scale ([1]: per tensor, or [out_i]: per channel); `activations` one of `ACTIVATIONS`,
        "static" with each part's input scale (the largest is used); `biases` in `dtype`."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"unknown FP8 activation scheme {activations!r}; known: {', '.join(ACTIVATIONS)}")
        self = cls.__new__(cls)
        rows = torch.cat([s.float().reshape(-1).expand(q.shape[0]) for q, s in zip(qs, scales)])
        bias = fuse_bias(biases, [q.shape[0] for q in qs], dtype, qs[0].device)
        static = max(input_scales) if activations == "static" else None
        self._hold(torch.cat(qs) if len(qs) > 1 else qs[0], rows, bias, activations, static)
        return self

    def _hold(self, q: torch.Tensor, row_scales: torch.Tensor, bias, activations: str, input_scale: float | None):
        self.q = q.contiguous()
        self.qt = self.q.t()  # [in, out], column-major: `_scaled_mm`'s second operand
        self.row_scales = row_scales.float().contiguous()  # [out]: what each output row's weights are scaled by
        self.bias = bias
        self.activations = activations
        self.out_features = int(q.shape[0])
        one_weight_scale = bool((self.row_scales == self.row_scales[0]).all())
        self.rowwise = activations == "token" or not one_weight_scale
        self.scale_b = self.row_scales.reshape(1, -1).contiguous() if self.rowwise else self.row_scales[0].clone()
        self.input_scale = None if input_scale is None else torch.tensor(float(input_scale), dtype=torch.float32,
                                                                          device=q.device)

    @property
    def layout(self) -> str:
        """The `_scaled_mm` scale layout this projection runs: "rowwise" or "tensorwise"."""
        return "rowwise" if self.rowwise else "tensorwise"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sx = self.input_scale if self.activations == "static" else dynamic_scale(x, per_token=True)
        xq = quantize_fp8(x, sx)
        if self.rowwise and sx.dim() == 0:
            sx = sx.expand(x.shape[0], 1).contiguous()
        out = torch._scaled_mm(xq, self.qt, scale_a=sx, scale_b=self.scale_b, out_dtype=x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        held = [self.q, self.scale_b] + ([self.input_scale] if self.input_scale is not None else [])
        return held + ([self.bias] if self.bias is not None else [])
