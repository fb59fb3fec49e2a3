"""scripts/npu_first_run.sh end to end against the fake torch_npu (tests/fakes/first_run_site puts
it in every Python process the script starts; DEVICE=cpu): every step runs under its timeout and
lands in one table — versions, the schema probe and the attention check, the kernel matrix (bf16
within tolerance of float32, fp16 refused by the kernel as PFA's TND tiling refuses it), the HCCL
pair with its sender killed mid-receive, core limits skipped (no profiler in the stand-in), and a
PD engine equal to transformers token for token."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "npu_first_run.sh"


def _table(stdout: str) -> dict[str, list[tuple[str, str]]]:
    rows: dict[str, list[tuple[str, str]]] = {}
    for line in stdout.splitlines()[1:]:
        step, status, detail = line[:36].strip(), line[36:45].strip(), line[45:].strip()
        rows.setdefault(step, []).append((status, detail))
    return rows


@pytest.mark.slow
def test_the_first_run_script_runs_end_to_end_on_the_fake(tmp_path):
    env = dict(os.environ, EPDSERVE_FAKE_TORCH_NPU="1", PYTHON=sys.executable, DEVICE="cpu",
               PYTHONPATH=f"{ROOT / 'tests' / 'fakes' / 'first_run_site'}:{ROOT}", STEP_TIMEOUT_S="400",
               EPDSERVE_FAKE_NPUS="2")
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _table(out.stdout)
    assert out.stdout.splitlines()[0].split() == ["step", "status", "detail"]
    assert rows["schema probe"] == [("ok", "torch_npu 2.12.0+fake: KV write scatter_norm")]
    assert rows["attention check"][0][0] == "ok"
    matrix = {k: v[0] for k, v in rows.items() if k.startswith("matrix")}
    assert len(matrix) == 12  # head_dim 64/128 x bf16/fp16 x three batch shapes
    assert all(s == "ok" and "max error" in d for k, (s, d) in matrix.items() if "bfloat16" in k)
    assert all(s == "refused" and "inputDataType should be bf16" in d for k, (s, d) in matrix.items() if "float16 " in k
               and "bfloat16" not in k)
    assert rows["hccl pair"][0][0] == "ok" and "peer killed mid-receive" in rows["hccl pair"][0][1]
    assert rows["hccl pair"][0][1].startswith("ranks on npu:0 and npu:1;")  # one rank per NPU
    assert rows["core limits"][0][0] == "skip"
    assert rows["decode graphs"] == [("skip", "the platform has no graphs (cpu decodes eagerly)")]  # --device cpu
    assert rows["pd end to end"][0][0] == "ok" and "8/8 tokens equal" in rows["pd end to end"][0][1]
    assert (tmp_path / "demo-small-d128").is_dir()  # head_dim 128, the size op-plugin's TND docs list
    assert {"versions.log", "hccl.tsv", "table.tsv"} <= {p.name for p in tmp_path.iterdir()}


def test_a_step_that_fails_fails_the_script(tmp_path):
    """Without epdserve importable the script stops at once, saying which interpreter to set."""
    env = dict(os.environ, PYTHON="/bin/false", DEVICE="cpu")
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot import epdserve: set PYTHON" in out.stderr


def test_the_hccl_step_puts_its_ranks_on_two_npus_or_says_why_not():
    """The end-to-end run above has two fake NPUs (ranks on npu:0 and npu:1); with one, the row says so."""
    from epdserve.checks.npu.first_run import hccl_placement

    assert hccl_placement(8) == (1, "ranks on npu:0 and npu:1")
    index, where = hccl_placement(1)
    assert index == 0 and where.startswith("one NPU visible: both ranks on npu:0")


def test_the_script_sources_cann_and_nnal(tmp_path):
    """NNAL's set_env.sh after CANN's: torch_npu 2.8 / 2.9 write the KV cache with ATB's kernel."""
    home = tmp_path / "Ascend"
    for rel, var in (("ascend-toolkit/set_env.sh", "FAKE_CANN_ENV"), ("nnal/atb/set_env.sh", "FAKE_ATB_ENV")):
        (home / rel).parent.mkdir(parents=True)
        (home / rel).write_text(f"export {var}=sourced\n")
    env = dict(os.environ, PYTHON=sys.executable, DEVICE="npu", ASCEND_HOME=str(home), ENV_ONLY="1",
               PYTHONPATH=str(ROOT))
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "FAKE_CANN_ENV=sourced" in out.stdout and "FAKE_ATB_ENV=sourced" in out.stdout
