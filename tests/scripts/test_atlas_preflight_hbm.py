"""scripts/atlas_node.sh's HBM preflight sizes what an instance needs — the checkpoint's weights
(safetensors sizes, scaled from config.json's dtype to the bf16 an NPU loads), the KV cache, and
HBM_MARGIN_MB — against the fake npu-smi's total and free HBM: the Atlas 800I A2 32 GB variant
passes for a model that fits, and a device too small for the model fails with one clear line."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.scripts.fake_atlas import make_fake_atlas

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "atlas_node.sh"
MB = 1 << 20


def _model(tmp_path, weights_mb: int, dtype: str = "bfloat16") -> Path:
    """A checkpoint folder: config.json naming `dtype`, one sparse *.safetensors of weights_mb."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "torch_dtype": dtype}))
    with open(model / "model.safetensors", "wb") as f:
        os.truncate(f.fileno(), weights_mb * MB)
    return model


def _preflight(env, **extra):
    return subprocess.run(["bash", str(SCRIPT), "preflight", "0", *extra.pop("args", [])], env=dict(env, **extra),
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
def atlas_32g(tmp_path):
    """An idle Atlas 800I A2 32 GB variant: 32768 MB HBM, 10 % in use (29491 MB free)."""
    return dict(make_fake_atlas(tmp_path), FAKE_HBM_MB="32768", FAKE_HBM_RATE="10")


def test_the_32g_variant_passes_for_a_7b_model_sizing_the_kv_cache(atlas_32g, tmp_path):
    out = _preflight(atlas_32g, MODEL=str(_model(tmp_path, 15813)))  # Qwen2-VL-7B-Instruct in bf16
    assert out.returncode == 0, out.stderr
    kv = 29491 - 15813 - 4096
    assert f"NPU 0 ok, 29491 MB of 32768 MB HBM free; needs {15813 + kv + 4096} MB (15813 weights + {kv} KV cache + 4096 margin)" in out.stdout


def test_the_32g_variant_passes_with_the_old_kv_figure_for_a_small_model(atlas_32g, tmp_path):
    out = _preflight(atlas_32g, MODEL=str(_model(tmp_path, 4000)), KV_CACHE_MB="16384")
    assert out.returncode == 0, out.stderr  # 36,864 MB fixed need before: failed on every 32 GB device
    assert "needs 24480 MB (4000 weights + 16384 KV cache + 4096 margin)" in out.stdout


def test_a_kv_cache_too_large_for_the_free_hbm_names_the_largest_that_fits(atlas_32g, tmp_path):
    out = _preflight(atlas_32g, MODEL=str(_model(tmp_path, 15813)), KV_CACHE_MB="16384")
    assert out.returncode == 1
    assert ("NPU 0 has 29491 MB of 32768 MB HBM free; this instance needs 36293 MB (15813 weights + 16384 KV cache"
            " + 4096 margin): lower KV_CACHE_MB to at most 9582") in out.stderr


def test_a_device_too_small_for_the_model_fails_with_one_clear_line(tmp_path):
    env = dict(make_fake_atlas(tmp_path), FAKE_HBM_MB="16384", FAKE_HBM_RATE="5")
    out = _preflight(env, MODEL=str(_model(tmp_path, 15813)))
    # one failure line; the version check's warning (this bare PATH's python3 has no epdserve) is not one
    failures = [line for line in out.stderr.splitlines() if line.startswith("atlas_node.sh:")]
    assert out.returncode == 1 and len(failures) == 1, out.stderr
    assert ("NPU 0 has 16384 MB HBM in all; this instance needs at least 20933 MB (15813 weights + 1024 KV cache"
            " + 4096 margin): the model does not fit this device") in out.stderr


def test_a_busy_device_says_so(atlas_32g, tmp_path):
    out = _preflight(dict(atlas_32g, FAKE_HBM_RATE="60"), MODEL=str(_model(tmp_path, 15813)))
    assert out.returncode == 1
    assert "NPU 0 has 13107 MB of 32768 MB HBM free" in out.stderr and "stop what runs there" in out.stderr


def test_fp32_weights_count_as_the_bf16_an_npu_loads_and_e_holds_no_kv(atlas_32g, tmp_path):
    model = str(_model(tmp_path, 8000, dtype="float32"))
    out = _preflight(atlas_32g, MODEL=model, ROLES="E", HBM_MARGIN_MB="2048")
    assert out.returncode == 0, out.stderr
    assert "needs 6048 MB (4000 weights + 0 KV cache + 2048 margin)" in out.stdout
    out = _preflight(atlas_32g, MODEL=model, ROLES="E", EXTRA_ARGS="--dtype float32")
    assert "(8000 weights + 0 KV cache + 4096 margin)" in out.stdout


def test_an_npu_that_npu_smi_marks_unavailable_is_named(atlas_32g, tmp_path):
    """npu-smi's manual: an NPU ID of -1 in `npu-smi info -m` marks an NPU that is not available."""
    out = _preflight(dict(atlas_32g, FAKE_NPU_ID="-1"), MODEL=str(_model(tmp_path, 4000)))
    assert out.returncode == 1 and "shows NPU ID -1 for it" in out.stderr, out.stderr


def test_a_product_without_hbm_is_named_not_reported_missing(atlas_32g, tmp_path):
    """Products without HBM print "Memory Capacity(MB)" in `npu-smi info -t usages` (npu-smi's manual)."""
    out = _preflight(dict(atlas_32g, FAKE_NO_HBM="1"), MODEL=str(_model(tmp_path, 4000)))
    assert out.returncode == 1 and "shows Memory Capacity(MB) but no HBM figures" in out.stderr, out.stderr


def test_an_id_with_no_row_in_the_mapping_says_so(atlas_32g, tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), "preflight", "7"], env=dict(atlas_32g, MODEL=str(_model(tmp_path, 4000))),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "NPU 7 not found by `npu-smi info -m` (no row with that Chip Logic ID)" in out.stderr


def test_tensor_parallel_sizes_each_npu_for_its_share_and_needs_whole_groups(atlas_32g, tmp_path):
    model = str(_model(tmp_path, 40000))  # does not fit one 32 GB NPU
    assert _preflight(atlas_32g, MODEL=model).returncode == 1
    out = subprocess.run(["bash", str(SCRIPT), "preflight", "0,1"], env=dict(atlas_32g, MODEL=model, TENSOR_PARALLEL_SIZE="2"),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "2 NPU(s), 1 instance(s) of 2; 20000 MB of weights per NPU" in out.stdout
    assert "NPU 1 ok" in out.stdout and "(20000 weights + " in out.stdout
    out = subprocess.run(["bash", str(SCRIPT), "preflight", "0,1,2"], env=dict(atlas_32g, MODEL=model, TENSOR_PARALLEL_SIZE="2"),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "TENSOR_PARALLEL_SIZE=2 needs the NPU list in groups of 2, got 3 NPU(s) (0,1,2)" in out.stderr
