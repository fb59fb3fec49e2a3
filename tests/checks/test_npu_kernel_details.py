"""epdserve/checks/npu/kernel_details.py on CPU, against kernel_details.csv fixtures whose headers
are copied from Ascend/pytorch torch_npu/profiler/analysis/prof_common_func/_csv_headers.py
CsvHeaders.OP_SUMMARY_KERNEL_BASE_HEADERS — the header KernelViewParser.generate_view
(prof_view/_kernel_view_parser.py) writes at Level0: "...,Block Dim" on v2.8.0-7.2.0 and
v2.9.0-7.3.0 (tests/fixtures/npu_kernel_details/kernel_details_2.8.0.csv), "...,Block Num" on
v2.12.0-26.1.0 (kernel_details_2.12.0.csv). The rows are made up (kernel names and values are
illustrations, not a recorded profile); the Accelerator Core values are CANN's op_summary Task
Types."""
import pathlib

import pytest

from epdserve.checks.npu.kernel_details import check, failures, find_kernel_details, read_kernels

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "npu_kernel_details"


def test_the_2_8_header_is_read_and_kernels_over_their_limit_named():
    kernels = read_kernels(FIXTURES / "kernel_details_2.8.0.csv")
    assert [k.block_dim for k in kernels] == [12, 24, 40, 20, 1]
    checks = check(kernels, cube=12, vector=24)
    assert [c.limit for c in checks] == [12, 24, 24, 12, None]  # AI_CPU: no AI Core limit applies
    assert failures(checks) == ["aclnnSilu_SiluAiCore_Swish", "aclnnMm_MatMulV2_MatMul"]


def test_the_2_12_header_says_block_num_and_mix_aic_takes_the_cube_limit():
    checks = check(read_kernels(FIXTURES / "kernel_details_2.12.0.csv"), cube=12, vector=24)
    assert [(c.limit, c.over) for c in checks] == [(24, False), (12, False)]
    assert failures(checks) == []


def test_a_file_without_block_dim_is_refused(tmp_path):
    bad = tmp_path / "kernel_details.csv"
    bad.write_text("Name,Accelerator Core\nx,AI_CORE\n")
    with pytest.raises(ValueError, match="Block Dim / Block Num"):
        read_kernels(bad)


def test_the_file_is_found_where_the_profiler_writes_it(tmp_path):
    out = tmp_path / "host_123_20250701085041123_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    (out / "kernel_details.csv").write_text((FIXTURES / "kernel_details_2.8.0.csv").read_text())
    assert find_kernel_details(tmp_path) == [out / "kernel_details.csv"]
