"""`epdserve launch` internal-port options become the scheduler's and the instances' flags: the
Registry's port (always its own, never the public one; resolved at launch, so a restarted
scheduler keeps it), its interface, mutual TLS files (scheduler: --internal-tls-*, instances:
--tls-*), and the address instances register at; inconsistent combinations are refused before
anything starts."""
from __future__ import annotations

import pytest

from epdserve.entrypoints.cli import build_parser
from epdserve.entrypoints.launch import spec_from_args


def spec(*argv):
    return spec_from_args(build_parser().parse_args(["launch", "--mode", "P-D", "--model", "/m", *argv]))


def test_internal_port_and_mutual_tls_reach_the_children(tmp_path):
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    s = spec("--internal-port", "0", "--internal-host", "0.0.0.0", "--host", "10.0.0.5",
             "--internal-tls-cert", str(files["cert"]), "--internal-tls-key", str(files["key"]),
             "--internal-tls-ca", str(files["ca"]))
    port = int(s.scheduler_args[s.scheduler_args.index("--internal-port") + 1])
    assert port > 0 and s.registry == f"10.0.0.5:{port}"  # a wildcard bind: instances dial --host
    assert s.scheduler_args[s.scheduler_args.index("--internal-host") + 1] == "0.0.0.0"
    for flag, name in (("--internal-tls-cert", "cert"), ("--internal-tls-key", "key"), ("--internal-tls-ca", "ca")):
        assert s.scheduler_args[s.scheduler_args.index(flag) + 1] == str(files[name])
    for flag, name in (("--tls-cert", "cert"), ("--tls-key", "key"), ("--tls-ca", "ca")):
        assert s.instance_args[s.instance_args.index(flag) + 1] == str(files[name])


def test_without_internal_port_instances_register_on_a_free_internal_one():
    s = spec()
    port = int(s.scheduler_args[s.scheduler_args.index("--internal-port") + 1])
    assert port > 0 and s.registry == f"127.0.0.1:{port}" and "--tls-ca" not in s.instance_args
    assert s.scheduler_args[s.scheduler_args.index("--internal-host") + 1] == "127.0.0.1"
    fixed = spec("--internal-port", "7123", "--internal-host", "127.0.0.2")
    assert fixed.registry == "127.0.0.2:7123" and "--tls-cert" not in fixed.instance_args


@pytest.mark.parametrize("argv, why", [
    (["--internal-port", "0", "--internal-tls-cert", "c"], "go together"),
    (["--internal-tls-key", "k", "--internal-tls-ca", "a"], "go together"),
])
def test_inconsistent_internal_options_are_refused(argv, why):
    with pytest.raises(ValueError, match=why):
        spec(*argv)
