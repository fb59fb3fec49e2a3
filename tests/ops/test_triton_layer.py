"""The Triton layer kernels and KV write (ops/triton_layer.py, issue 52 item 4) on this CPU through
Triton's interpreter, against the portable ops (one subprocess runs every case of
triton_layer_cases.py: fp32 and bf16, row lengths that are not powers of two, strided rows, no
residual, rotary of q and k strided views with fewer KV heads, SiLU-and-mul over two chunks, the
KV write at scattered slots); the start-up checks passing and refusing; CUDA choosing
`TritonLayerOps`; and the engine's runner calling the check.

Bit for bit where the arithmetic is the same: the sum, rotary, the KV write, and RMSNorm wherever
the sum of squares is exact (small whole numbers). Elsewhere the bounds, derived:
- RMSNorm's fp32 sum of squares is taken in another order. N terms, each error at most (N - 1)
  units of 2^-24 relative to the sum (the worst case of any order), halved by the square root,
  then the rsqrt and the two products each rounded once: at most N/2 + 4 fp32 ulps of the output.
  In bf16 that fp32 difference can move `h.to(bf16)` by one bf16 ulp, only when h lies that close
  to a rounding boundary (rare: at most a few per 10^4 elements at these sizes, the test allows
  1%); `weight *` of two values one ulp apart differs by under two ulps of the product, so at most
  2 bf16 ulps after its rounding.
- SiLU's exp: torch's CPU kernel uses its own vectorized exp (within 2 fp32 ulps), the interpreter
  numpy's (within 1): the fp32 output within 6 ulps (exp, the +1, the division, the product); in
  bf16 `silu(gate)` moves by one ulp only near a rounding boundary (the same rarity): at most 2
  bf16 ulps and 1% of the elements. On CUDA both sides call CUDA's expf (libdevice) and divide
  correctly rounded, so the difference is not expected there (not measured: no GPU here).
"""
import logging
import re
import sys
from pathlib import Path

import pytest

from epdserve.ops.select import layer_ops
from epdserve.platform.cuda import CudaPlatform
from tests.ops.interpreter import interpreted_rows

CASES = Path(__file__).with_name("triton_layer_cases.py")


@pytest.fixture(scope="module")
def run():
    """The cases script's JSON lines, run once under Triton's interpreter."""
    return interpreted_rows(CASES)


def _ops(run, prefix):
    rows = [r for r in run if r.get("op", "").startswith(prefix)]
    assert rows, prefix
    return rows


def test_the_sum_rotary_and_kv_write_equal_the_portable_ops_bit_for_bit(run):
    for r in _ops(run, "add_rms_norm.summed") + _ops(run, "rotary.") + _ops(run, "kv_write."):
        assert r["equal"], r
    assert len(_ops(run, "rotary.")) == 12 and len(_ops(run, "kv_write.")) == 8
    assert all(r["in_place"] for r in _ops(run, "rotary.q"))  # rotated where the fused output lies
    assert all(r["v_untouched"] for r in _ops(run, "rotary.k"))  # nothing written past k
    assert all(r["summed_is_x"] for r in run if r.get("case", "").endswith("no-residual"))


def test_rms_norm_within_its_reduction_order_bound(run):
    norms = _ops(run, "add_rms_norm.normed") + _ops(run, "rms_norm")
    assert len(norms) == 20
    for r in norms:
        if r["kind"] == "whole":  # an exact sum of squares: no order to differ in
            assert r["equal"], r
        elif r["case"].startswith("bfloat16"):
            assert r["ulps"] <= 2 and r["differ"] <= r["numel"] // 100, r
        else:
            assert r["ulps"] <= r["N"] / 2 + 4, r


def test_silu_and_mul_within_the_exp_bound(run):
    rows = _ops(run, "silu_and_mul")
    assert len(rows) == 4
    for r in rows:
        if r["case"].startswith("bfloat16"):
            assert r["ulps"] <= 2 and r["differ"] <= r["numel"] // 100, r
        else:
            assert r["ulps"] <= 6, r


def test_the_startup_checks_pass_and_refuse_a_wrong_or_failing_kernel(run):
    assert [r for r in run if "startup_check" in r] == [{"startup_check": "float32"}, {"startup_check": "bfloat16"}]
    refused = {r["refused"]: r["message"] for r in run if "message" in r}
    for wrapper, what in (("_norm", "add \\+ RMSNorm"), ("_rotary", "rotary"), ("_silu_mul", "SiLU-and-mul"),
                          ("_write", "KV-write")):
        assert refused[wrapper] is not None, wrapper
        assert re.fullmatch(f"the Triton {what} kernel's (output|caches) differ.*EPDSERVE_OPS=portable",
                            refused[wrapper]), refused[wrapper]
    assert refused["_silu_mul-fails"] == ("the Triton SiLU-and-mul kernel does not run here (RuntimeError: PTX "
                                          "compile failed); set EPDSERVE_OPS=portable")


def test_cuda_takes_the_triton_layer_ops_unless_told_portable():
    ops = layer_ops(CudaPlatform())  # the selection reads the platform's name: no GPU needed
    assert ops.name == "triton" and type(ops).__name__ == "TritonLayerOps"
    assert layer_ops(CudaPlatform(), "portable").name == "portable"


def test_without_triton_cuda_layer_ops_are_the_portable_ones_said_once(monkeypatch, caplog):
    from epdserve.ops.select import _warn_once

    _warn_once.cache_clear()  # "once" counted from here
    monkeypatch.setitem(sys.modules, "epdserve.ops.triton_layer_ops", None)  # `import` raises ImportError
    with caplog.at_level(logging.WARNING, logger="epdserve.ops.select"):
        assert layer_ops(CudaPlatform()).name == "portable"
        assert layer_ops(CudaPlatform()).name == "portable"
    said = [r.getMessage() for r in caplog.records if "CUDA's layer operators are the portable" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_the_runner_checks_its_layer_ops_at_the_models_shapes():
    import dataclasses

    import torch
    from transformers import AutoModelForImageTextToText

    from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
    from epdserve.engine.lm.forward import LeanLM
    from epdserve.engine.model_runner import ModelRunner
    from epdserve.model.adapter import VLMAdapter
    from epdserve.model.demo import PRESETS, demo_config
    from epdserve.ops.layer_ops import LayerShapes, PortableLayerOps
    from epdserve.ops.portable import PortableOps
    from epdserve.platform import get_platform

    class Told(PortableLayerOps):
        def __init__(self):
            self.told = []

        def check(self, shapes, device):
            self.told.append((shapes, str(device)))

    ids = {"<|endoftext|>": 1990, "<|im_end|>": 1991, "<|image_pad|>": 1992, "<|video_pad|>": 1993,
           "<|vision_start|>": 1994, "<|vision_end|>": 1995}
    size = dataclasses.replace(PRESETS["tiny"], layers=1)
    model = AutoModelForImageTextToText.from_config(demo_config("qwen2_vl", size, ids, vocab=2000),
                                                    dtype=torch.bfloat16).eval()
    a = VLMAdapter(model)
    lm = LeanLM(a, 256)
    kv = PagedKVCache(KVCacheSpec(1, a.num_kv_heads, a.head_dim, 16, torch.bfloat16), num_blocks=4)
    ops = Told()
    ModelRunner(a, lm, kv, PortableOps(), ops, get_platform("cpu"))
    tc = a.text_config
    assert ops.told == [(LayerShapes(tc.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, tc.intermediate_size,
                                     torch.bfloat16), "cpu")]
