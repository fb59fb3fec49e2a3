"""bench serve end to end on the tiny model: real `epdserve launch` processes, real gRPC, real client."""
import json

import psutil
import pytest

from epdserve.deploy.local.launched import launched
from epdserve.entrypoints.cli import main

WORKLOAD = ["--workload", "mixed", "--num-requests", "6", "--output-len", "4", "--output-len-std", "1",
            "--output-len-range", "3-5", "--request-rate", "inf", "--warmup", "1", "--no-progress"]


def _check_run(run, n):
    m = run["metrics"]
    assert (m["completed"], m["failed"], m["incomplete_outputs"]) == (n, 0, 0)
    assert m["input_vision_tokens"] > 0 and m["input_text_tokens"] > 0 and m["ttft_ms"]["count"] == n
    assert set(m["by_kind"]) == {"image", "text"}
    assert m["stages_ms"]["requests_with_timings"] == n and "prefill" in m["stages_ms"]
    images = [r for r in run["requests"] if r["kind"] == "image"]
    assert images and all(r["vision_tokens"] > 0 and "encode" in r["stages_ms"] for r in images)
    return m


@pytest.mark.slow  # two deployments start (30-60 s each on 2 cores)
def test_modes_side_by_side_launched_and_stopped(qwen2_vl_tiny, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--modes", "monolithic,E-P-D", "--model", str(qwen2_vl_tiny), *WORKLOAD,
               "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    modes = rep["workloads"]["mixed"]["modes"]
    assert list(modes) == ["monolithic", "E-P-D"]
    for mode in modes:
        assert rep["targets"][mode]["ready_line"].startswith("epdserve ready")
        _check_run(modes[mode]["runs"][0], 6)
    # disaggregated: the KV went P -> D, so the server stamped it
    assert "P->D" in modes["E-P-D"]["runs"][0]["metrics"]["stages_ms"]
    printed = capsys.readouterr().out
    assert "| E-P-D | inf | 6/0 |" in printed
    assert (tmp_path / "serve.md").is_file() and (tmp_path / "serve-mixed.png").stat().st_size > 10_000


@pytest.mark.slow  # one deployment starts
def test_against_a_live_address_repeated_images_hit_the_mm_store(qwen2_vl_tiny, tmp_path):
    out = tmp_path / "live.json"
    with launched("E-PD", str(qwen2_vl_tiny), log_dir=str(tmp_path)) as dep:
        children = psutil.Process(dep.pid).children(recursive=True)
        assert children  # scheduler + instances (+ the private MM Store)
        rc = main(["bench", "serve", "--address", dep.address, "--label", "e-pd-live", *WORKLOAD,
                   "--num-requests", "8", "--text-only-share", "0", "--repeated-image-share", "0.5",
                   "--max-concurrency", "1", "--out", str(out)])  # one at a time: a repeat finds its image stored
        assert rc == 0
    rep = json.loads(out.read_text())
    run = rep["workloads"]["mixed"]["modes"]["e-pd-live"]["runs"][0]
    m = run["metrics"]
    assert (m["completed"], m["failed"]) == (8, 0)
    assert m["cached_vision_tokens"] > 0  # repeated images were served from the MM Store
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)  # all stopped
