"""The Ascend NPU checks: what a fresh Atlas node needs, and what it does.

Modules:
- `doctor_rows`: doctor's Ascend rows: driver / CANN / torch_npu against the table, what the
  core-limit API documents;
- `pins`: the torch / torch_npu pins of the NPU extras, for doctor's exact-pin fix;
- `first_run`: the steps of scripts/npu_first_run.sh (versions, schema probe, kernel matrix, HCCL
  pair with a peer killed, core limits, PD against transformers), one table row each;
- `colocation`: `bench colocation --device npu`, each stage's kernels under the profiler against
  its core limit;
- `kernel_details`: reads torch_npu's profiler kernel_details.csv, names kernels over their limit.
"""
