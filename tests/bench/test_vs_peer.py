"""The peer comparison as one command (`benchmarks/vs_transformers_serve.py --quick`), with a
stand-in OpenAI server as the peer (tests/bench/fake_openai_server.py): the peer's process
handling, every rate repeated, the merged report and the printed tables."""
import json
import pathlib
import shlex
import sys

import pytest

from epdserve.bench.peer import PEER_CMD, PeerError, ensure_peer_venv, peer_argv, peer_requirements, serving
from epdserve.bench.vs_peer import main
from epdserve.net import free_port

FAKE = pathlib.Path(__file__).with_name("fake_openai_server.py")


def _fake_peer(ttft_ms=30, itl_ms=5) -> str:
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} --port {{port}} --ttft-ms {ttft_ms} --itl-ms {itl_ms}"


def test_peer_command_and_venv_pins(tmp_path):
    argv = peer_argv(PEER_CMD, venv="/v", model="/m dir", port=8123)
    assert argv[:4] == ["/v/bin/transformers", "serve", "--continuous-batching", "--device"]
    assert argv[-1] == "/m dir" and "8123" in argv and "--host" in argv
    reqs = peer_requirements("5.24.0")
    assert reqs == ["torch==2.14.1", "torchvision==0.29.1", "transformers[serving]==5.24.0"]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "transformers").write_text("")
    assert ensure_peer_venv(tmp_path, log=lambda m: pytest.fail("built again")) == tmp_path  # already there


def test_a_peer_that_exits_early_is_an_error_with_its_output():
    with pytest.raises(PeerError, match="(?s)exited with 3.*boom"):
        with serving([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                     f"http://127.0.0.1:{free_port()}/health", ready_timeout_s=30):
            pass


def test_quick_run_against_the_stand_in_peer(tmp_path, capsys):
    out = tmp_path / "vs.json"
    rc = main(["--quick", "--modes", "", "--rates", "4,8", "--repeats", "2", "--model", str(tmp_path),
               "--peer-cmd", _fake_peer(), "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    runs = rep["workloads"]["sharegpt4o"]["modes"]["transformers-serve"]["runs"]
    assert [r["rate"] for r in runs] == [4, 8, 4, 8]  # rates interleaved, each run twice
    assert runs[0]["seed"] != runs[2]["seed"]  # each repeat its own (fresh) images
    for r in runs:
        m = r["metrics"]
        assert (m["completed"], m["failed"]) == (4, 0) and m["good_requests"] == 4
        assert 4 <= m["tpot_ms"]["p50"] <= m["tpot_ms"]["p90"] <= m["tpot_ms"]["p99"]
        assert m["itl_ms"]["p99"] >= 4 and m["itl_ms"]["count"] == 4 * 3  # 4 tokens: 3 gaps per request
    assert rep["workloads"]["sharegpt4o"]["config"]["resolution_mix"] == {"320x180": 0.5, "480x270": 0.3,
                                                                         "640x360": 0.2}
    assert rep["slo"] == {"ttft_ms": 3000.0, "tpot_ms": 100.0, "e2el_ms": None}
    printed = capsys.readouterr().out
    assert "| 4/s | transformers-serve | 2 |" in printed and "TPOT p99 ms | ITL p50 ms | ITL p99 ms | SLO goodput" in printed
    assert out.with_suffix(".md").read_text().strip() in printed
    out.with_suffix(".md").unlink()  # --render: the tables again from the JSON, nothing run
    assert main(["--render", str(out)]) == 0
    assert out.with_suffix(".md").read_text().strip() in capsys.readouterr().out
    assert "| 4/s | transformers-serve | 2 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow  # one epdserve deployment starts (30-60 s on 2 cores)
def test_quick_run_with_an_epdserve_mode(qwen2_vl_tiny, tmp_path, capsys):
    out = tmp_path / "vs.json"
    rc = main(["--quick", "--modes", "monolithic", "--rates", "2", "--model", str(qwen2_vl_tiny),
               "--peer-cmd", _fake_peer(), "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    modes = rep["workloads"]["sharegpt4o"]["modes"]
    assert list(modes) == ["transformers-serve", "epdserve-monolithic"]
    m = modes["epdserve-monolithic"]["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (4, 0) and m["tpot_ms"]["p99"] is not None
    assert not rep["failed"]
    printed = capsys.readouterr().out
    assert "| 2/s | epdserve-monolithic | 1 |" in printed


def test_vllm_as_the_peer_command_environment_and_run(tmp_path, capsys):
    """--peer vllm: its OpenAI server from its own venv, bf16, images only, both cores bound (vLLM's
    CPU docs); the run names it and sends vLLM's extra fields (the stand-in accepts them)."""
    from epdserve.bench.peer_vllm import VLLM_CMD, vllm_env
    from epdserve.bench.vs_peer import workload_args

    assert "--no-vllm-extras" not in workload_args("vllm") and "--no-vllm-extras" in workload_args("transformers-serve")

    argv = peer_argv(VLLM_CMD, venv="/v", model="/m", port=8124)
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"video":0,"image":2}'
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--port") + 1] == "8124"
    env = vllm_env(tmp_path)
    import os
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{len(os.sched_getaffinity(0)) - 1}"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    out = tmp_path / "vs.json"
    assert main(["--quick", "--peer", "vllm", "--modes", "", "--rates", "4", "--model", str(tmp_path),
                 "--peer-cmd", _fake_peer(), "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert list(rep["workloads"]["sharegpt4o"]["modes"]) == ["vllm"]
    printed = capsys.readouterr().out
    assert "## epdserve vs vllm" in printed and "| 4/s | vllm | 1 |" in printed
