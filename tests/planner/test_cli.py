"""`epdserve plan` from the command line: help, presets, validation, and bad input."""
import subprocess
import sys

from epdserve.entrypoints.cli import main

from .conftest import PROFILE, SERVE


def test_help_explains_the_command():
    out = subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "plan", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for word in ("--profile", "--workload", "--devices", "--colocated-host", "--validate", "--out", "goodput"):
        assert word in out.stdout


def test_missing_profile_is_a_clear_error(tmp_path, capsys):
    rc = main(["plan", "--profile", str(tmp_path / "none.json"), "--workload", "mixed"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"profile {tmp_path / 'none.json'} not found" in err and "epdserve profile" in err


def test_bad_inputs_exit_nonzero_with_the_reason(tmp_path, capsys):
    cases = [
        (["--workload", "nope"], "unknown workload 'nope'"),
        ([], "give one of --workload"),
        (["--workload", "mixed", "--modes", "X-Y"], "unknown mode(s) X-Y"),
        (["--trace", str(tmp_path / "missing.json")], "not found"),
        (["--workload", "mixed", "--model", str(tmp_path)], "not a checkpoint directory"),
        (["--trace", str(SERVE), "--devices", "0"], "--devices must be >= 1"),
    ]
    for extra, message in cases:
        rc = main(["plan", "--profile", str(PROFILE), *extra])
        err = capsys.readouterr().err
        assert rc == 2, extra
        assert message in err, (extra, err)


def test_a_preset_is_counted_with_the_checkpoint(qwen2_vl_tiny, capsys):
    from epdserve.planner.shapes import shapes_from_preset

    shapes = shapes_from_preset("mixed", 1.0, str(qwen2_vl_tiny), num_requests=6)
    assert len(shapes) == 6
    assert all(s.text_tokens > 0 and s.output_tokens >= 4 for s in shapes)
    assert any(s.vision_items for s in shapes) and any(not s.vision_items for s in shapes)
    rc = main(["plan", "--profile", str(PROFILE), "--workload", "mixed", "--requests", "6", "--rate", "2",
               "--model", str(qwen2_vl_tiny), "--devices", "2", "--top", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "| 1 |" in out and "| 4 |" not in out and "best:" in out


def test_validate_compares_every_cell(capsys):
    import json

    rc = main(["plan", "--profile", str(PROFILE), "--validate", str(SERVE), "--colocated-host"])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(SERVE.read_text())
    for wname, entry in data["workloads"].items():
        for mode, m in entry["modes"].items():
            for run in m["runs"]:
                assert f"| {wname} | {mode} | {run['rate']:g} |" in out
                assert f"{run['metrics']['goodput']:.3f}" in out
    assert "mean |error|" in out


def test_degrees_take_a_profile_each_and_count_devices_per_rank(tmp_path, capsys):
    import json

    tp2 = tmp_path / "tp2.json"
    tp2.write_text(json.dumps({**json.loads(PROFILE.read_text()), "tensor_parallel_size": 2}))
    base = ["plan", "--profile", str(PROFILE), "--trace", str(SERVE), "--tensor-parallel-size", "2"]
    assert main([*base, "--devices", "4"]) == 2
    assert "no profile at tensor_parallel_size 2" in capsys.readouterr().err
    assert main([*base, "--profile", str(PROFILE), "--devices", "4"]) == 2
    assert "two profiles at tensor_parallel_size 1" in capsys.readouterr().err
    assert main([*base, "--profile", str(tp2), "--devices", "1"]) == 2
    assert "fits 1 device(s) at --tensor-parallel-size 2" in capsys.readouterr().err
    assert main([*base, "--profile", str(tp2), "--devices", "2", "--modes", "monolithic,E-PD"]) == 0
    out = capsys.readouterr().out
    assert "--tensor-parallel-size 2" in out and "EPDx2" not in out and "best: monolithic (EPDx1)" in out
