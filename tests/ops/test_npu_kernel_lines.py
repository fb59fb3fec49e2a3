"""The version matrix of issue 26: on each torch_npu line the extras install, the KV write is
chosen by the schema the line registers (ops/npu_schema.py), and where no call can write our
layout the engine refuses at construction; the fake's binding, npu config and get_device_limit
are checked against torch itself and the line's source (tests/fakes/npu_config_fake.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from epdserve.ops.npu_ops import NpuPagedOps
from epdserve.ops.npu_schema import ATB_ND, SCATTER_ND, NpuKernelsUnsupported, probe_npu_kernels
from tests.fakes.npu_kernels_fake import LINES, bind, line_schemas
from tests.fakes.torch_npu_fake import FakeTorchNpu


def test_the_fixtures_are_the_three_lines_the_extras_install():
    assert LINES == ("2.8.0", "2.9.0", "2.12.0")
    for line in LINES:
        assert set(line_schemas(line)) == {"npu::npu_scatter_pa_kv_cache", "npu::npu_fused_infer_attention_score",
                                           "atb::_npu_reshape_and_cache", "npu::npu_add_rms_norm", "npu::npu_rms_norm",
                                           "npu::npu_rotary_mul", "npu::npu_apply_rotary_pos_emb", "npu::npu_swiglu",
                                           "npu::npu_weight_quant_batchmatmul", "npu::npu_dynamic_quant",
                                           "npu::npu_quantize", "npu::npu_quant_matmul",
                                           "npu::npu_fused_infer_attention_score.out",
                                           "npu::_npu_fused_infer_attention_score_get_max_workspace",
                                           "npu::npu_convert_weight_to_int4pack"}
        # the int4 packing's schema is the same on every line (op-plugin 7.2.0, 7.3.0, 26.1.0)
        assert str(line_schemas(line)["npu::npu_convert_weight_to_int4pack"]) == \
            "npu::npu_convert_weight_to_int4pack(Tensor weight, int inner_k_tiles=0) -> Tensor"
    for op in ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score.out",
               "_npu_fused_infer_attention_score_get_max_workspace"):
        assert len({str(line_schemas(line)[f"npu::{op}"]) for line in LINES}) == 1  # the same on every line


@pytest.mark.parametrize("line,kv_write", [("2.8.0", ATB_ND), ("2.9.0", ATB_ND), ("2.12.0", SCATTER_ND)])
def test_the_kv_write_is_chosen_by_the_schema(monkeypatch, line, kv_write):
    fake = FakeTorchNpu(line=line).install(monkeypatch)
    assert hasattr(fake.module, "npu_scatter_pa_kv_cache")  # present on every line: hasattr cannot choose
    assert probe_npu_kernels(fake.module).kv_write == kv_write


@pytest.mark.parametrize("line", ["2.8.0", "2.9.0"])
def test_an_old_line_without_the_atb_library_is_refused_at_construction(monkeypatch, line):
    FakeTorchNpu(line=line, atb_loaded=False).install(monkeypatch)
    with pytest.raises(NpuKernelsUnsupported, match="no cache_mode.*libop_plugin_atb.so"):
        NpuPagedOps()


def test_the_newest_line_needs_no_atb_library(monkeypatch):
    FakeTorchNpu(line="2.12.0", atb_loaded=False).install(monkeypatch)
    assert NpuPagedOps()._kernels.kv_write == SCATTER_ND
    with pytest.raises(OSError, match="nnal"):  # the lazy ATB wrapper raises the saved load error
        sys.modules["torch_npu"]._npu_reshape_and_cache()


CALLS = [
    ((1, 1, 1), {}),
    ((1, 1, 1), {"cache_mode": "Norm"}),
    ((1, 1, 1, None), {}),
    ((1, 1, 1, None, "x", 2), {}),
    ((1, 1), {}),
    ((1, 1, 1), {"foo": 1, "bar": 2}),
    ((1, 1), {"slot_mapping": 1, "key": 1}),
]


@pytest.mark.parametrize("args,kwargs", CALLS)
def test_the_fake_binds_a_call_as_torch_does(args, kwargs):
    """Against torch's own binding of an operator registered with a schema of the same shape."""
    decl = "scatter(Tensor key, Tensor(a!) key_cache, Tensor slot_mapping, *, Tensor? seq_lens=None) -> ()"
    lib = torch.library.Library("epdserve_bind_check", "FRAGMENT")
    if not hasattr(torch.ops.epdserve_bind_check, "scatter"):
        lib.define(decl)
        lib.impl("scatter", lambda *a, **k: None, "CompositeExplicitAutograd")
    t = torch.zeros(1)
    real_args = tuple(t if a == 1 else a for a in args)
    real_kwargs = {k: t if v == 1 else v for k, v in kwargs.items()}
    try:
        torch.ops.epdserve_bind_check.scatter(*real_args, **real_kwargs)
        real = None
    except RuntimeError as e:
        real = str(e).splitlines()[0]
    schema = torch.ops.epdserve_bind_check.scatter.default._schema
    try:
        bind(schema, args, kwargs)
        ours = None
    except RuntimeError as e:
        ours = str(e).splitlines()[0]
    assert ours == real


@pytest.mark.parametrize("line", LINES)
def test_allow_internal_format_is_write_only_and_off_by_default(line):
    fake = FakeTorchNpu(line=line)
    assert fake.options["ALLOW_INTERNAL_FORMAT"] == "disable"
    with pytest.raises(AttributeError):
        fake.module.npu.config.allow_internal_format  # _npuConfig has no __getattr__
    fake.module.npu.config.allow_internal_format = True
    assert fake.options["ALLOW_INTERNAL_FORMAT"] == "enable"


@pytest.mark.parametrize("line", LINES)
def test_get_device_limit_takes_what_the_line_takes(line):
    npu = FakeTorchNpu(line=line, devices=2).module.npu
    limits = {"cube_core_num": 20, "vector_core_num": 40}
    assert npu.get_device_limit(1) == limits
    with pytest.raises(AssertionError, match="Invalid device id"):
        npu.get_device_limit(2)
    if line == "2.12.0":
        with pytest.raises(TypeError, match="device must be an int, but got str"):
            npu.get_device_limit("npu:1")
    else:
        assert npu.get_device_limit("npu:1") == npu.get_device_limit(None) == limits
        with pytest.raises(ValueError, match="Expected a npu device"):
            npu.get_device_limit("cpu")
