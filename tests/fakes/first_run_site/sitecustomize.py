"""Puts the fake torch_npu (tests/fakes/torch_npu_fake.py, the newest line, FIA computed by the
contract test's stand-in) in place in every Python process started with this folder on
PYTHONPATH: how tests/scripts/test_npu_first_run.py runs scripts/npu_first_run.sh end to end on
a host without an NPU. Tests only."""
import os

if os.environ.get("EPDSERVE_FAKE_TORCH_NPU") == "1":
    # transformers probes find_spec("torch_npu") when its modelling modules import: before the fake
    import transformers.models.qwen2_vl.modeling_qwen2_vl  # noqa: F401

    from tests.fakes.torch_npu_fake import FakeTorchNpu
    from tests.ops.test_npu_ops_contract import _fia

    # EPDSERVE_FAKE_NPUS: how many NPUs the fake has (default 1)
    FakeTorchNpu(kernels={"npu_fused_infer_attention_score": _fia},
                 devices=int(os.environ.get("EPDSERVE_FAKE_NPUS", "1"))).install()
