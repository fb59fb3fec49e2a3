"""Reading torch_npu's profiler `kernel_details.csv` and checking each kernel's Block Dim against
the core limit of the stage that launched it — the hardware check of docs/npu-colocation.md.

What the file is (Ascend/pytorch torch_npu/profiler/analysis/, read on v2.8.0-7.2.0, v2.9.0-7.3.0
and v2.12.0-26.1.0):
- written by prof_view/_kernel_view_parser.py `KernelViewParser.generate_view` (KERNEL_VIEW =
  "kernel_details.csv") into `<dir>/<worker>_<time>_ascend_pt/ASCEND_PROFILER_OUTPUT/`
  (_profiling_parser.py `__init__`: output path = profiler path + Constant.OUTPUT_DIR
  "ASCEND_PROFILER_OUTPUT"; _profiler_path_creator.py: the "_ascend_pt" span name), for every
  profiler level but Level_none (_profiling_parser.py `run_parser`: COMMON_CONFIG holds
  KernelViewParser, LEVEL_NONE_CONFIG does not);
- its header: CANN's op_summary columns renamed by `_project_map_for_headers` from
  prof_common_func/_csv_headers.py CsvHeaders.OP_SUMMARY_SHOW_HEADERS to
  OP_SUMMARY_KERNEL_BASE_HEADERS: "Device_id", "Name", "Type", "Accelerator Core" (CANN's
  "Task Type"), "Start Time(us)", "Duration(us)", "Wait Time(us)" and "Block Dim" on 2.8.0 / 2.9.0,
  "Block Num" on 2.12.0; "Step Id" first when a schedule marked steps. At Level0 these are all
  the columns; above it (2.8 / 2.9: aic_metrics set; 2.12: level != Level0,
  _profiler_config.py `is_all_kernel_headers`) every op_summary column follows, named by CANN.
- "Stream ID" is one of CANN's op_summary columns (msprof op_summary reference), not in
  torch_npu's source: read when present, never required.

Which limit binds a kernel: op-plugin torch_npu-set_stream_limit.md ("core limit takes effect"
example) compares BlockDim with the limit set; its example limits a vector operator (SwiGlu)
with the vector number. So AI_CORE / MIX_AIC kernels are held to the cube limit, AI_VECTOR_CORE /
MIX_AIV to the vector limit (CANN op_summary "Task Type" values); any other type (AI_CPU, HCCL,
...) runs on no AI Core and is listed, not checked.
"""
from __future__ import annotations

import csv
import pathlib
from dataclasses import dataclass

BLOCK_COLUMNS = ("Block Dim", "Block Num")  # 2.8.0 / 2.9.0; 2.12.0
REQUIRED = ("Name", "Accelerator Core")
CUBE_TYPES = frozenset({"AI_CORE", "MIX_AIC"})
VECTOR_TYPES = frozenset({"AI_VECTOR_CORE", "MIX_AIV"})
OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
FILE_NAME = "kernel_details.csv"


@dataclass(frozen=True)
class Kernel:
    name: str
    type: str
    core: str  # "Accelerator Core"
    block_dim: int | None
    stream_id: str | None


@dataclass(frozen=True)
class KernelCheck:
    kernel: Kernel
    limit: int | None  # the cube or vector limit it is held to; None: not an AI Core kernel
    over: bool


def read_kernels(path: str | pathlib.Path) -> list[Kernel]:
    """The kernels of one kernel_details.csv; ValueError where its header lacks a column we need."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in REQUIRED if c not in header]
        block = next((c for c in BLOCK_COLUMNS if c in header), None)
        if missing or block is None:
            raise ValueError(f"{path}: not a torch_npu kernel_details.csv (missing "
                             f"{', '.join(missing + ([] if block else ['Block Dim / Block Num']))})")
        return [Kernel(row["Name"], row.get("Type", ""), row["Accelerator Core"], _int(row[block]),
                       row.get("Stream ID") or None) for row in reader]


def find_kernel_details(profile_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Every `*_ascend_pt/ASCEND_PROFILER_OUTPUT/kernel_details.csv` under `profile_dir`."""
    return sorted(pathlib.Path(profile_dir).glob(f"*_ascend_pt/{OUTPUT_DIR}/{FILE_NAME}"))


def check(kernels: list[Kernel], cube: int, vector: int) -> list[KernelCheck]:
    """Each kernel against the limit that binds its core type (`cube` / `vector` cores)."""
    out = []
    for k in kernels:
        limit = cube if k.core in CUBE_TYPES else vector if k.core in VECTOR_TYPES else None
        out.append(KernelCheck(k, limit, limit is not None and k.block_dim is not None and k.block_dim > limit))
    return out


def failures(checks: list[KernelCheck]) -> list[str]:
    """Names of the kernels over their limit, each once, in launch order."""
    return list(dict.fromkeys(c.kernel.name for c in checks if c.over))


def _int(value: str) -> int | None:
    try:
        return int(float(value))
    except (TypeError, ValueError):  # "N/A" for HCCL tasks (CANN op_summary reference)
        return None
