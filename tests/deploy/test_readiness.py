"""The launcher's readiness probe against real schedulers on loopback: what its timeout message
says it saw — the roster (registered instances and their health), or that the scheduler never
answered and the last error it gave (TLS spoken to plaintext and back, a missing API key) — and
that it passes with the credentials the deployment hands out (TLS root, API key)."""
from __future__ import annotations

import pytest

from epdserve.deploy.local.argv import last_flag
from epdserve.deploy.local.readiness import RosterProbe
from epdserve.rpc import serve_pb2_grpc
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security import Secret
from epdserve.security.options import SchedulerSecurity
from tests.security.certs import self_signed


@pytest.fixture(autouse=True)
def no_ambient_keys(monkeypatch):
    monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("EPDSERVE_CLUSTER_TOKEN", raising=False)


def poll_once(probe: RosterProbe) -> bool:
    with probe.channel() as ch:
        return probe.poll(serve_pb2_grpc.EPDServeStub(ch), timeout_s=2.0)


def test_last_flag_reads_both_spellings_and_the_last_wins():
    argv = ["--tls-cert", "a.pem", "--x", "1", "--tls-cert=b.pem"]
    assert last_flag(argv, "--tls-cert") == "b.pem" and last_flag(argv, "--tls-key") is None


def test_report_names_the_roster_when_instances_are_missing(qwen2_vl_tiny):
    with SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), port=0)) as sched:
        probe = RosterProbe(sched.address, want=2)
        assert poll_once(probe) is False
    assert probe.report() == "0 of 2 instances registered, 0 HEALTHY"


def test_plaintext_probe_of_a_tls_scheduler_says_so_and_the_cert_as_root_passes(qwen2_vl_tiny, tmp_path):
    cert, key = self_signed(tmp_path)
    security = SchedulerSecurity(tls_cert=cert, tls_key=key)
    with SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), port=0), security=security) as sched:
        plain = RosterProbe(sched.address, want=0)
        assert poll_once(plain) is False
        with_tls = RosterProbe(sched.address, want=0, tls_ca=cert)
        assert poll_once(with_tls) is True  # want=0: it answered over TLS
    report = plain.report()
    assert report.startswith(f"the scheduler at {sched.address} never answered the probe; last error from the "
                             "scheduler: UNAVAILABLE"), report
    assert "pass --tls-cert/--tls-key to launch" in report


def test_a_probe_without_the_api_key_reports_unauthenticated(qwen2_vl_tiny, monkeypatch):
    security = SchedulerSecurity(api_key=Secret("the-key-0123"))
    with SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), port=0), security=security) as sched:
        probe = RosterProbe(sched.address, want=0)
        assert poll_once(probe) is False
        monkeypatch.setenv("EPDSERVE_API_KEY", "the-key-0123")  # what `launch` hands its children and its probe
        assert poll_once(RosterProbe(sched.address, want=0)) is True
    assert "last error from the scheduler: UNAUTHENTICATED: missing or wrong API key" in probe.report()
    assert "EPDSERVE_API_KEY" in probe.report() and "the-key-0123" not in probe.report()
