"""`epdserve launch` option handling: configs/<mode>.yaml, flags over file, and a failed start."""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from epdserve.entrypoints.cli import build_parser
from epdserve.entrypoints.launch import load_config, spec_from_args
from epdserve.instance.modes import MODES, Pool

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def spec(*argv):
    return spec_from_args(build_parser().parse_args(["launch", *argv]))


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_has_a_config_that_launches_that_mode(mode):
    s = spec("--config", str(CONFIGS / f"{mode}.yaml"), "--model", "/m")
    assert s.mode == mode and s.model == "/m" and s.device == "cpu" and s.port == 0
    assert s.mm_store is None  # a private local server
    roles = "".join(p.roles for p in s.pools())
    assert "P" in roles and "D" in roles


def test_flags_override_the_file_and_become_instance_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: EP-D\nmodel: /from/file\nprefill: 2\ndecode: 3\nkv_cache_mb: 64\n"
                   "instance_args: '--encode-core-share 0.25'\ndevices: 0,1\n")
    s = spec("--config", str(cfg), "--decode", "1", "--mm-store", "redis://h:1/0", "--max-model-len", "512",
             "--pin-instances")
    assert (s.mode, s.model, s.prefill, s.decode, s.mm_store) == ("EP-D", "/from/file", 2, 1, "redis://h:1/0")
    assert s.pools() == [Pool("EP", 2), Pool("D", 1)]
    assert s.instance_args == ["--encode-core-share", "0.25", "--kv-cache-mb", "64", "--max-model-len", "512"]
    assert s.scheduler_args[:2] == ["--max-model-len", "512"] and s.devices == ["0", "1"] and s.pin_instances
    assert s.scheduler_args[2:4] == ["--http-port", "0"]  # the OpenAI front, by default, on a port it binds
    assert s.scheduler_args[4:6] == ["--internal-port", s.registry.rsplit(":", 1)[1]]  # the Registry's own port


def test_no_model_is_the_built_in_demo_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("EPDSERVE_CACHE_DIR", str(tmp_path))
    s = spec("--mode", "E-P-D")
    assert s.demo_model and Path(s.model).parent == tmp_path / "demo-models"
    assert (Path(s.model) / "config.json").is_file()
    assert not spec("--mode", "E-P-D", "--model", "/m").demo_model


def test_bad_options_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="--mode"):
        spec("--model", "/m")
    with pytest.raises(ValueError, match="needs at least one"):
        spec("--mode", "E-P-D", "--model", "/m", "--decode", "0").pools()
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: E-P-D\nreplicas: 3\n")
    with pytest.raises(ValueError, match="unknown option"):
        load_config(bad)
    bad.write_text("mode: EP-D\ncolocation: slo\n")  # a value outside a setting's choices: the removed policy
    with pytest.raises(ValueError, match="colocation: 'slo' is not one of split, yield"):
        load_config(bad)
    bad.write_text("mode: X-Y\n")
    with pytest.raises(ValueError, match="mode: 'X-Y' is not one of"):
        load_config(bad)


def test_a_launch_that_cannot_start_exits_nonzero_and_leaves_nothing(tmp_path):
    """The scheduler fails on a directory that is no model: launch reports it and stops everything."""
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "epdserve.entrypoints.cli", "launch", "--mode", "monolithic", "--model",
         str(tmp_path / "no-model"), "--log-dir", str(logs), "--ready-timeout-s", "120"],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "epdserve ready" not in proc.stdout
    assert "launch failed" in proc.stderr and "scheduler" in proc.stderr
    assert (logs / "scheduler.log").is_file()
    left = [p for p in psutil.process_iter(["cmdline"]) if str(logs) in " ".join(p.info["cmdline"] or [])]
    assert not left


def test_prefill_and_decode_degrees_parse_and_reach_the_deployment(tmp_path):
    """Issue 48 item 1: --prefill-tensor-parallel-size / --decode-tensor-parallel-size (or their --config
    keys) reach the DeploymentSpec; 0, their default, means --tensor-parallel-size; --help explains each."""
    s = spec("--mode", "E-P-D", "--model", "/m", "--prefill-tensor-parallel-size", "2",
             "--decode-tensor-parallel-size", "4")
    assert (s.prefill_tensor_parallel_size, s.decode_tensor_parallel_size) == (2, 4)
    assert "--prefill-tensor-parallel-size" not in s.instance_args  # launch's own: each pool's degree, not every one's
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: ED-P\nprefill_tensor_parallel_size: 2\ndecode-tensor-parallel-size: 8\n")
    s = spec("--config", str(cfg), "--model", "/m", "--decode-tensor-parallel-size", "4")
    assert (s.prefill_tensor_parallel_size, s.decode_tensor_parallel_size) == (2, 4)  # the flag wins over the file
    s = spec("--mode", "E-P-D", "--model", "/m")
    assert (s.prefill_tensor_parallel_size, s.decode_tensor_parallel_size) == (0, 0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser(["launch", "--help"]).parse_args(["launch", "--help"])
    text = " ".join(out.getvalue().split())
    assert "--prefill-tensor-parallel-size" in text and "--decode-tensor-parallel-size" in text
    assert "0: --tensor-parallel-size" in text and "P->D KV hop carries" in text



def test_the_openai_front_is_on_by_default_and_minus_one_turns_it_off():
    """vLLM users expect an HTTP port: launch gives the scheduler one (0: the scheduler binds a free
    one itself); --http-port -1 serves gRPC only; below -1 is an error."""
    on = spec("--mode", "P-D", "--model", "/m")
    assert on.scheduler_args[on.scheduler_args.index("--http-port") + 1] == "0"
    assert spec("--mode", "P-D", "--model", "/m", "--http-port", "8123").scheduler_args.count("8123") == 1
    assert "--http-port" not in spec("--mode", "P-D", "--model", "/m", "--http-port", "-1").scheduler_args
    with pytest.raises(ValueError, match="--http-port must be a port, 0 .* or -1"):
        spec("--mode", "P-D", "--model", "/m", "--http-port", "-2")


def test_the_scheduler_binds_the_http_port_and_a_restart_comes_back_on_it():
    """No pick-then-bind race: with --http-port 0 the scheduler binds a free port itself and writes
    it to its HTTP address file; the launcher reads it (the ready line's http=) and hands that port
    to a restarted scheduler."""
    from epdserve.deploy.local.deployment import Deployment

    dep = Deployment(spec("--mode", "P-D", "--model", "/m"))
    first = dep._scheduler_child(5000, dep.log_dir / "scheduler.address").argv
    assert first[first.index("--http-address-file") + 1] == str(dep._http_file())
    assert [a for a in first if a == "--http-port"] == ["--http-port"]  # launch's 0 only
    dep.http_port = 43210  # what _start_scheduler read from the file
    again = dep._scheduler_child(5000, dep.log_dir / "scheduler.address").argv
    assert again[len(again) - 1 - again[::-1].index("--http-port") + 1] == "43210"  # the last one wins
    off = Deployment(spec("--mode", "P-D", "--model", "/m", "--http-port", "-1"))
    assert "--http-address-file" not in off._scheduler_child(5000, off.log_dir / "a").argv
