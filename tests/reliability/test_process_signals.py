"""Signals to real epdserve processes, and the supervisor bringing the dead back.

- an `epdserve instance` SIGTERMed over and over while it is still loading exits within its
  stated bound (--drain-timeout + INSTANCE_STOP_MARGIN_S), without ever printing ready;
- a launched deployment under load: its instance is SIGTERMed over and over (while serving, and
  while stopping) and exits within the bound; `launch` restarts it; then the scheduler and the MM
  Store server are SIGKILLed and come back (the scheduler on its port, the instance registered
  again, the store empty); greedy outputs stay equal to transformers'; finally the launcher is
  SIGKILLed and leaves no process and no listening port behind; with --max-restarts 1, the MM
  Store killed a second time is a crash loop: reported, left dead, and the deployment serves on;
- `launch` SIGTERMed over and over while starting exits 0 and leaves nothing behind.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from epdserve.client import Client, EPDServeError
from epdserve.deploy.local.signals import INSTANCE_STOP_MARGIN_S
from epdserve.model.reference import ReferenceGenerator
from tests.instance.harness import PH, image, wait_until
from tests.reliability.helpers import alive, family, kill_group, launch, listening, signal_storm, wait_exit

pytestmark = pytest.mark.slow

DRAIN_S = 2.0
SLACK_S = 5.0  # process start-up and scheduling noise on a loaded 2-core machine


def _handles_sigterm(pid: int) -> bool:
    """Whether the process has installed its SIGTERM handler (bit 15 of SigCgt in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_instance_sigtermed_while_starting_exits_within_its_bound(qwen2_vl_tiny):
    proc = subprocess.Popen([sys.executable, "-m", "epdserve.entrypoints.cli", "instance", "--roles", "EPD",
                             "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--drain-timeout", str(DRAIN_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _handles_sigterm(proc.pid) or proc.poll() is not None, 60, "the SIGTERM handler")
        t0 = time.monotonic()
        storm = threading.Thread(target=signal_storm, args=(proc.pid, signal.SIGTERM, 200, 0.01))
        storm.start()
        proc.wait(DRAIN_S + INSTANCE_STOP_MARGIN_S + SLACK_S)
        took = time.monotonic() - t0
        storm.join()
        out = proc.stdout.read()
        assert "epdserve instance ready" not in out, out
        assert took < DRAIN_S + INSTANCE_STOP_MARGIN_S + SLACK_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def references(qwen2_vl_tiny):
    gen = ReferenceGenerator(qwen2_vl_tiny)
    return {"text": gen.generate("Tell me a story.", max_tokens=12),
            "image": gen.generate(f"Describe {PH} now.", [image(5, 84, 56)], max_tokens=12)}


def _exact(address: str, references) -> None:
    with Client(address, timeout=120) as c:
        assert c.generate("Tell me a story.", max_tokens=12, ignore_eos=True).token_ids == references["text"]
        assert c.generate(f"Describe {PH} now.", images=[image(5, 84, 56)], max_tokens=12,
                          ignore_eos=True).token_ids == references["image"]


def _healthy_roster(address: str, want: int) -> bool:
    try:
        with Client(address, timeout=5) as c:
            return sum(1 for i in c.server_info().instances if i.health == 1) >= want
    except EPDServeError:
        return False


def test_signals_under_load_restarts_and_a_killed_launcher(qwen2_vl_tiny, references):
    dep = launch(qwen2_vl_tiny, "--mode", "monolithic", "--drain-timeout", str(DRAIN_S), "--max-restarts", "1",
                 "--restart-stable-s", "3600")  # the store's second death counts as a crash loop however late it lands
    everyone = family(dep.proc.pid)
    ports = [dep.address, dep.mm_store]
    try:
        kids = dep.children()
        inst = next(p for name, p in kids.items() if name.startswith("instance:"))
        ports.append(next(c.laddr for c in inst.net_connections("tcp") if c.status == psutil.CONN_LISTEN))
        # load: clients looping while the instance is told to stop, over and over
        done, errors, finished = threading.Event(), [], []

        def client_loop(i):
            with Client(dep.address, timeout=120) as c:
                while not done.is_set():
                    try:
                        r = c.generate(f"Load {i}", max_tokens=16, ignore_eos=True)
                        finished.append(len(r.token_ids))
                    except EPDServeError as e:  # no instance while it restarts
                        errors.append(e.code.name)
                        time.sleep(0.2)

        loaders = [threading.Thread(target=client_loop, args=(i,)) for i in range(3)]
        for t in loaders:
            t.start()
        wait_until(lambda: len(finished) >= 3, 120, "load to flow")
        t0 = time.monotonic()
        signal_storm(inst.pid, signal.SIGTERM, 100, 0.02)  # while serving, then while stopping
        wait_exit([inst], DRAIN_S + INSTANCE_STOP_MARGIN_S + SLACK_S)
        assert time.monotonic() - t0 < DRAIN_S + INSTANCE_STOP_MARGIN_S + SLACK_S
        # the supervisor brings it back and it registers
        wait_until(lambda: any(n.startswith("instance:") and p.pid != inst.pid for n, p in dep.children().items()),
                   30, "the instance to be restarted")
        wait_until(lambda: _healthy_roster(dep.address, 1), 120, "the restarted instance to register")
        n = len(finished)
        wait_until(lambda: len(finished) > n, 120, "load to flow again")
        done.set()
        for t in loaders:
            t.join(180)
        assert all(k == 16 for k in finished)
        assert set(errors) <= {"UNAVAILABLE"}, errors
        _exact(dep.address, references)

        # the scheduler and the MM Store server SIGKILLed: back on their ports, the instance registered again
        kids = dep.children()
        everyone += [kids["scheduler"], kids["mm_store"]]
        kids["scheduler"].kill()
        kids["mm_store"].kill()
        def restarted() -> bool:
            now = dep.children()  # one snapshot: the supervisor may be restarting either of them meanwhile
            return "mm_store" in now and "scheduler" in now and now["scheduler"].pid != kids["scheduler"].pid

        wait_until(restarted, 30, "scheduler and store restarted")
        wait_until(lambda: _healthy_roster(dep.address, 1), 120, "the instance to register again")
        _exact(dep.address, references)
        log = "".join(dep.output)  # the launcher's own log (its stderr) is in its output
        assert "the scheduler exited" in log and "the MM Store server started again" in log
        everyone = list({p.pid: p for p in [*everyone, *family(dep.proc.pid)]}.values())
        restarted_inst = next(p for name, p in dep.children().items() if name.startswith("instance:"))
        ports.append(next(c.laddr for c in restarted_inst.net_connections("tcp") if c.status == psutil.CONN_LISTEN))

        # the MM Store dies again: a crash loop (--max-restarts 1), reported and not restarted
        store = dep.children()["mm_store"]
        store.kill()
        wait_until(lambda: "the MM Store server is in a crash loop" in "".join(dep.output), 30, "the crash loop report")
        time.sleep(1.0)  # past the first backoff: it would have been restarted by now
        assert "mm_store" not in dep.children()
        _exact(dep.address, references)

        # the launcher SIGKILLed: every process and port gone within seconds
        dep.proc.kill()
        dep.proc.wait()
        wait_exit(everyone, 15.0)
        for p in ports:
            addr = p if isinstance(p, str) else f"{p.ip}:{p.port}"
            assert not listening(addr), f"{addr} still listening"
    finally:
        kill_group(dep.proc)
        for p in alive(everyone):
            p.kill()


def test_launcher_sigtermed_while_starting_exits_cleanly(qwen2_vl_tiny):
    dep = launch(qwen2_vl_tiny, "--mode", "monolithic", "--drain-timeout", str(DRAIN_S), wait_ready=False)
    try:
        wait_until(lambda: len(dep.children()) >= 3, 60, "the launcher to start its children")
        everyone = family(dep.proc.pid)
        signal_storm(dep.proc.pid, signal.SIGTERM, 50, 0.02)
        assert dep.proc.wait(DRAIN_S + 20 + SLACK_S) == 0, dep.tail()
        assert not dep.address
        wait_exit(everyone, 5.0)
    finally:
        kill_group(dep.proc)
