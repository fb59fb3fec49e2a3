"""What scripts/atlas_node.sh `instances` hands epdserve on an NPU server (a fake `epdserve`
records its environment and flags): HCCL_HOST_SOCKET_PORT_RANGE only when the operator sets it —
CANN documents it for Atlas A3 and, among A2 machines, only the 800T A2, 900 A2 PoD and 200T A2
Box16 (CANN 9.0.0 HCCL user guide, HCCL_HOST_SOCKET_PORT_RANGE, "Supported models"), not the
800I A2 — and the KV cache the HBM preflight found fits."""

import json
import os
import subprocess
from pathlib import Path

from tests.scripts.fake_atlas import make_fake_atlas

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "atlas_node.sh"
FAKE_EPDSERVE = """#!/bin/sh
env > "$FAKE_OUT/env"
echo "$@" > "$FAKE_OUT/args"
"""


def _instances(tmp_path, weights_mb=4000, npus="0", roles="P", ok=True,
               **extra) -> tuple[subprocess.CompletedProcess, dict, str]:
    tmp_path.mkdir(exist_ok=True)
    env = make_fake_atlas(tmp_path)
    (tmp_path / "bin" / "epdserve").write_text(FAKE_EPDSERVE)
    (tmp_path / "bin" / "epdserve").chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    with open(model / "model.safetensors", "wb") as f:
        os.truncate(f.fileno(), weights_mb << 20)
    env.update(MODEL=str(model), HEAD_IP="127.0.0.1", NODE_IP="127.0.0.1", NIC="lo", INSECURE="1",
               MM_STORE="redis://127.0.0.1:1/0", FAKE_OUT=str(tmp_path), **extra)
    out = subprocess.run(["bash", str(SCRIPT), "instances", roles, npus], env=env, capture_output=True, text=True,
                         timeout=30)
    if not ok:
        assert out.returncode != 0
        return out, {}, ""
    assert out.returncode == 0, out.stderr
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    return out, seen, (tmp_path / "args").read_text()


def test_no_port_range_unless_the_operator_sets_one(tmp_path):
    _, env, args = _instances(tmp_path)
    assert "HCCL_HOST_SOCKET_PORT_RANGE" not in env
    assert env["HCCL_IF_IP"] == "127.0.0.1" and env["HCCL_SOCKET_IFNAME"] == "=lo"
    # 65536 MB at 25 % in use: 49152 free - 4000 weights - 4096 margin leaves room for the 16384 cap
    assert "--kv-cache-mb 16384" in args


def test_a_port_range_the_operator_sets_is_passed_on_with_the_documented_products(tmp_path):
    out, env, _ = _instances(tmp_path, HCCL_HOST_SOCKET_PORT_RANGE="61000-61015")
    assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "61000-61015"
    assert "Atlas A3, 800T A2, 900 A2 PoD and 200T A2 Box16 only" in out.stderr


def test_the_kv_cache_instances_start_with_is_what_the_preflight_found_fits(tmp_path):
    _, _, args = _instances(tmp_path, weights_mb=15813, FAKE_HBM_MB="32768", FAKE_HBM_RATE="10")  # 800I A2 32 GB
    assert f"--kv-cache-mb {29491 - 15813 - 4096}" in args


def test_a_tensor_parallel_instance_gets_its_group_of_npus(tmp_path):
    """TENSOR_PARALLEL_SIZE=2 with NPUs 0,1: one PD instance, both NPUs visible to it, at degree 2; a
    P instance (its KV crosses to a D) at TP2 is refused before anything starts, naming why."""
    out, env, args = _instances(tmp_path, npus="0,1", roles="PD", TENSOR_PARALLEL_SIZE="2")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and "--tensor-parallel-size 2" in args
    assert "started 1 PD instance(s)" in out.stdout and "2 NPU(s) each" in out.stdout
    _, env, args = _instances(tmp_path / "split", npus="0,1", roles="P", TENSOR_PARALLEL_SIZE="2")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and "--tensor-parallel-size 2" in args  # a P at TP2 starts too
    _, env, args = _instances(tmp_path / "one", npus="0")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0" and "--tensor-parallel-size" not in args


def test_each_role_takes_its_own_degree_and_group_of_npus(tmp_path):
    """Issue 48 item 1, the Atlas 800I A2 example (docs/tensor-parallel.md): ENCODE_/PREFILL_/
    DECODE_TENSOR_PARALLEL_SIZE (unset or 0: TENSOR_PARALLEL_SIZE) give E, P and D instances their own
    degree: E at 1 on NPU 0, P at 2 on 2,3, D at 4 on 4-7; PD keeps TENSOR_PARALLEL_SIZE. (A stand-in
    PYTHON says the hop carries every pair: which pairs it carries is kv_layout's word.)"""
    degrees = dict(ENCODE_TENSOR_PARALLEL_SIZE="1", PREFILL_TENSOR_PARALLEL_SIZE="2", DECODE_TENSOR_PARALLEL_SIZE="4",
                   TENSOR_PARALLEL_SIZE="8", FAKE_CHIPS="8")
    for roles, npus, want in (("E", "0", "1"), ("P", "2,3", "2"), ("EP", "2,3", "2"), ("D", "4,5,6,7", "4"),
                              ("ED", "4,5,6,7", "4")):
        out, env, args = _instances(tmp_path / roles, npus=npus, roles=roles, **degrees)
        assert env["ASCEND_RT_VISIBLE_DEVICES"] == npus, roles
        assert (f"--tensor-parallel-size {want}" in args) == (want != "1") and f"{want} NPU(s) each" in out.stdout
    _, env, args = _instances(tmp_path / "PD", npus="0,1", roles="PD", TENSOR_PARALLEL_SIZE="2",
                              PREFILL_TENSOR_PARALLEL_SIZE="4", DECODE_TENSOR_PARALLEL_SIZE="4")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and "--tensor-parallel-size 2" in args
    _, env, args = _instances(tmp_path / "zero", npus="0,1", roles="D", TENSOR_PARALLEL_SIZE="2",
                              DECODE_TENSOR_PARALLEL_SIZE="0")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and "--tensor-parallel-size 2" in args
    out, _, _ = _instances(tmp_path / "groups", npus="4,5,6", roles="D", ok=False, DECODE_TENSOR_PARALLEL_SIZE="4",
                           FAKE_CHIPS="8")
    assert "DECODE_TENSOR_PARALLEL_SIZE=4 needs the NPU list in groups of 4, got 3 NPU(s)" in out.stderr
