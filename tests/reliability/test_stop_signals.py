"""`deploy.signals.StopSignals` in real processes: signal storms never deadlock, a hung stop is
ended by the deadline, and a child whose launcher was SIGKILLed stops (PR_SET_PDEATHSIG and the
parent-pid watch)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from epdserve.deploy.local.signals import PARENT_PID_ENV
from tests.instance.harness import wait_until
from tests.reliability.helpers import signal_storm, wait_exit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _catches_sigterm(pid: int) -> bool:
    """Whether `pid` has a SIGTERM handler installed (the SigCgt mask of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _start(deadline_s: float, mode: str, env=None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "tests.reliability.stop_target", str(deadline_s), mode], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_storm_of_signals_stops_the_process_cleanly(sig):
    p = _start(30.0, "wait")
    sent = signal_storm(p.pid, sig, 500, 0.001)
    assert p.wait(10) == 0, p.stdout.read()
    assert "stopped" in p.stdout.read()
    assert sent >= 1


def test_a_hung_stop_is_ended_by_the_deadline():
    p = _start(1.0, "hang")
    signal_storm(p.pid, signal.SIGTERM, 20, 0.01)
    assert p.wait(120) == 1  # the deadline's exit code: the hung stop (it never returns) was ended by it


def test_children_stop_when_their_launcher_is_killed():
    """A middle process starts two targets as `ChildProcess`es (PR_SET_PDEATHSIG, EPDSERVE_PARENT_PID),
    then is SIGKILLed: both targets stop."""
    middle = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from epdserve.deploy.local.procs import ChildProcess\n"
        "cs = [ChildProcess(f't{i}', ['30', 'wait'], module='tests.reliability.stop_target').start() for i in range(2)]\n"
        "print(' '.join(str(c.pid) for c in cs), flush=True)\n"
        "time.sleep(600)\n")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in middle.stdout.readline().split()]
    kids = [psutil.Process(pid) for pid in pids]
    assert all(str(middle.pid) == k.environ().get(PARENT_PID_ENV) for k in kids)
    wait_until(lambda: all(_catches_sigterm(k.pid) for k in kids), what="the targets' SIGTERM handlers")
    middle.kill()
    middle.wait()
    wait_exit(kids, 10.0)
