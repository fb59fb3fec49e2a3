"""`epdserve launch`'s pass-through flags and public TLS, as parsed (no process started):
--scheduler-args / --instance-args take a value that starts with --, in either spelling; the
scheduler gets --served-model-name (default: --model as given), --tls-cert/--tls-key as absolute
paths, and with public TLS an internal Registry port for the instances."""
from __future__ import annotations

import pytest

from epdserve.deploy.local.argv import last_flag
from epdserve.entrypoints.cli import build_parser
from epdserve.entrypoints.launch import spec_from_args
from tests.security.certs import self_signed


def spec(*argv: str):
    argv = ["launch", "--mode", "P-D", "--model", "demo-dir", *argv]
    return spec_from_args(build_parser(argv).parse_args(argv))


@pytest.mark.parametrize("form", [("--scheduler-args", "--allow-remote-images"),
                                  ("--scheduler-args=--allow-remote-images",)])
def test_scheduler_args_may_start_with_dashes(form):
    s = spec(*form, "--instance-args", "--kv-cache-mb 8")
    assert "--allow-remote-images" in s.scheduler_args
    assert s.instance_args[:2] == ["--kv-cache-mb", "8"]


def test_a_flag_after_the_passed_value_is_still_launchs():
    s = spec("--scheduler-args", "--allow-remote-images", "--port", "0", "--instance-args", "--kv-cache-mb=8")
    assert s.port == 0 and s.instance_args[0] == "--kv-cache-mb=8"


def test_served_model_name_defaults_to_the_model_as_given_and_scheduler_args_win():
    assert last_flag(spec().scheduler_args, "--served-model-name") is None and spec().model == "demo-dir"  # its own default
    argv = ["launch", "--mode", "P-D", "--model", "./demo-dir/"]
    s = spec_from_args(build_parser(argv).parse_args(argv))
    assert last_flag(s.scheduler_args, "--served-model-name") == "./demo-dir/" and s.model == "demo-dir"
    assert last_flag(spec("--served-model-name", "qwen").scheduler_args, "--served-model-name") == "qwen"
    s = spec("--served-model-name", "qwen", "--scheduler-args", "--served-model-name other")
    assert last_flag(s.scheduler_args, "--served-model-name") == "other"


def test_public_tls_goes_to_the_scheduler_and_moves_registration_to_an_internal_port(tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    monkeypatch.chdir(tmp_path)
    s = spec("--tls-cert", "cert.pem", "--tls-key", "key.pem")
    assert last_flag(s.scheduler_args, "--tls-cert") == cert and last_flag(s.scheduler_args, "--tls-key") == key
    assert last_flag(s.scheduler_args, "--internal-port") is not None and s.registry is not None
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        spec("--tls-cert", cert)
    with pytest.raises(ValueError, match="no such file"):
        spec("--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", key)
