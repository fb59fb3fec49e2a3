"""Does this machine and this install work: `epdserve doctor`'s checks and the acceptance checks.

Owns checking, not measuring: each check answers pass / warn / fail with what to fix; the
benchmarks (`epdserve.bench`) measure configurations side by side. The command lines stay thin in
`epdserve.entrypoints` (`doctor_cli`) and `epdserve.bench.cli` (`bench device`, `bench colocation
--device npu`); scripts/device_check.sh and scripts/npu_first_run.sh run them on a fresh machine.
Modules:
- `doctor`: the checks behind `epdserve doctor`, one `Check` row each (versions, devices, the
  mode's instances, dist backend, native operators, MM Store, scheduler);
- `device/`: `epdserve bench device`, the device check (exactness against transformers, every
  mode served, decode speed, memory floor; GPU / NPU / CPU);
- `npu/`: the Ascend checks: doctor's NPU rows, the extras' pins, the first run on a fresh Atlas
  node, each stage's kernels against its core limit.
"""
