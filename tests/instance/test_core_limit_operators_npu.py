"""A core limit only where every operator of the stage may run under one (ops/npu_core_limits.py,
docs/npu-colocation.md), on the fake torch_npu of each line: on 2.8.0 / 2.9.0 the KV write is the
ATB `_npu_reshape_and_cache`, which ignores core limits (op-plugin torch_npu-set_stream_limit.md),
so a P or D stage gets no stream limit and a warning naming it. E, and P / D on 2.12.0
(`npu_scatter_pa_kv_cache`, Ascend C), run aten operators not verified to keep to a limit
(ops/npu_aten_routes.py: aclnn route, kernel language not shown): no limit by default (issue 37
item 5: a limited stream running non-Ascend C operators may hang), limited with --npu-core-limits,
each named."""
import logging

import pytest

from epdserve.instance.stage_stream import npu_stage_operators, open_stage_stream
from epdserve.ops.npu_ops import NpuPagedOps
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.npu import NpuPlatform
from tests.fakes.torch_npu_fake import FakeTorchNpu


def _open(role: str, share: float = 0.5, opted_in: bool = True):
    npu = NpuPlatform()
    npu.set_thread_device(0)
    total = npu.device_limit()
    npu.limit_device(0, total["cube_core_num"], total["vector_core_num"])  # set_device_limit first (its doc)
    return open_stage_stream(npu, share, f"{role}-worker", operators=npu_stage_operators(npu, role, NpuPagedOps()),
                             opted_in=opted_in)


@pytest.mark.parametrize("line", ["2.8.0", "2.9.0"])
@pytest.mark.parametrize("role", ["P", "D"])
def test_the_atb_kv_write_keeps_p_and_d_unlimited_and_is_named(line, role, monkeypatch, caplog):
    fake = FakeTorchNpu(line=line).install(monkeypatch)
    with caplog.at_level(logging.WARNING):
        stream = _open(role)
    assert stream is not None and stream.limits is None and not fake.of("set_stream_limit")
    assert f"{role}-worker: no stream core limit: _npu_reshape_and_cache ignore(s) core limits" in caplog.text


@pytest.mark.parametrize("line", ["2.8.0", "2.12.0"])
def test_e_is_limited_on_every_line_its_aten_operators_named_unverified(line, monkeypatch, caplog):
    fake = FakeTorchNpu(line=line, cores=(20, 40)).install(monkeypatch)
    with caplog.at_level(logging.WARNING):
        stream = _open("E", 0.3)
    assert stream.limits == (6, 12) and len(fake.of("set_stream_limit")) == 1
    assert "E-worker: stream core limit set; not verified to bind aten::convolution (aclnnConvolution)" in caplog.text
    assert "aten::mm (aclnnMm)" in caplog.text and "aten::embedding" not in caplog.text


def test_p_on_2_12_is_limited_its_kv_write_being_ascend_c(monkeypatch, caplog):
    FakeTorchNpu(line="2.12.0", cores=(20, 40)).install(monkeypatch)
    with caplog.at_level(logging.WARNING):
        stream = _open("P", 0.7)
    assert stream.limits == (14, 28)
    assert "_npu_reshape_and_cache" not in caplog.text and "npu_scatter_pa_kv_cache" not in caplog.text


@pytest.mark.parametrize("role", ["E", "P"])
def test_without_the_opt_in_unverified_operators_keep_the_stream_unlimited(role, monkeypatch, caplog):
    fake = FakeTorchNpu(line="2.12.0", cores=(20, 40)).install(monkeypatch)
    with caplog.at_level(logging.WARNING):
        stream = _open(role, 0.3, opted_in=False)
    assert stream.limits is None and not fake.of("set_stream_limit")
    assert f"{role}-worker: no stream core limit (off by default on NPU)" in caplog.text
    assert "--npu-core-limits" in caplog.text and "aten::mm (aclnnMm)" in caplog.text


def test_no_npu_operators_elsewhere():
    assert npu_stage_operators(CpuPlatform(), "P", None) == []


def test_every_aten_operator_of_a_stage_is_classified_and_none_claims_to_honour_limits():
    from epdserve.ops.npu_aten_routes import LANGUAGE, ROUTES, VISION
    from epdserve.ops.npu_core_limits import UNVERIFIED, stage_operators

    assert set(VISION) | set(LANGUAGE) <= set(ROUTES)
    aten = [op for op in stage_operators("EPD", None) if op.name.startswith("aten::")]
    assert aten and all(op.limit == UNVERIFIED and "aclnn" in op.name for op in aten)
    assert len({op.name for op in aten}) == len(aten)  # each named once
