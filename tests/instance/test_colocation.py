"""The co-location policy (instance/colocation.py): what each policy gives a worker, that an
encode thread under `yield` and the OpenMP team it spawns run at SCHED_IDLE on every core while
a P/D thread's team stays normal, that an instance applies it to its workers, and that the removed `slo`
policy is refused."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from epdserve.entrypoints.cli import build_parser
from epdserve.instance.colocation import device_share, enter_stage_thread, stream_priority, worker_core_sets, yields
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost


def test_what_each_policy_gives():
    cores = [0, 1, 2, 3]
    assert worker_core_sets("split", ["E", "P"], cores, [0.5, 0.5]) == [[0, 1], [2, 3]]
    assert worker_core_sets("yield", ["E", "P"], cores, [0.5, 0.5]) == [cores, cores]
    assert worker_core_sets("split", ["PD"], cores, [1.0]) == [cores]
    assert yields("yield", "E") and not yields("yield", "P") and not yields("split", "E")
    assert device_share("split", "E", 0.3) == 0.3 and device_share("yield", "E", 0.3) is None
    assert stream_priority("yield", "D") < stream_priority("yield", "E") == stream_priority("split", "D") == 0
    for policy in ("greedy", "slo"):  # slo: removed (docs/measurements.md)
        with pytest.raises(ValueError, match="co-location policy"):
            yields(policy, "E")
        with pytest.raises(ValueError, match="co-location policy"):
            InstanceConfig(roles="EP", model="m", colocation=policy)


@pytest.mark.parametrize("command", [["instance", "--roles", "EP"], ["launch", "--mode", "EP-D"]])
def test_the_removed_slo_policy_is_refused_on_the_command_line(command, capsys):
    argv = [*command, "--model", "/m", "--colocation", "slo"]
    with pytest.raises(SystemExit) as stop:
        build_parser(argv).parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--colocation: invalid choice: 'slo'" in err and "split" in err and "yield" in err, err


def _thread_policies(low_priority: bool) -> tuple[int, set[int]]:
    """Run a parallel op on a fresh stage thread; its own policy and those of the threads it spawned."""
    out: dict = {}
    before = set(os.listdir("/proc/self/task"))

    def body():
        enter_stage_thread(sorted(os.sched_getaffinity(0)), low_priority)
        a = torch.randn(512, 512)
        for _ in range(4):
            a = torch.tanh(a @ a)
        out["own"] = os.sched_getscheduler(threading.get_native_id())
        team = set()
        for tid in set(os.listdir("/proc/self/task")) - before:
            try:
                if int(tid) != threading.get_native_id():
                    team.add(os.sched_getscheduler(int(tid)))
            except OSError:
                continue
        out["team"] = team

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["own"], out["team"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an OpenMP team needs two cores")
def test_a_yielding_thread_and_its_team_run_at_sched_idle():
    own, team = _thread_policies(low_priority=True)
    assert own == os.SCHED_IDLE and team == {os.SCHED_IDLE}
    own, team = _thread_policies(low_priority=False)
    assert own == os.SCHED_OTHER and os.SCHED_IDLE not in team


def test_an_ep_instance_under_yield(qwen2_vl_tiny):
    host = InstanceHost(InstanceConfig(roles="EP", model=str(qwen2_vl_tiny), kv_cache_bytes=4 << 20,
                                       colocation="yield")).start()
    try:
        e, p = host.workers
        assert (e.role, p.role) == ("E", "P")
        assert e.bound_cores == p.bound_cores == sorted(os.sched_getaffinity(0))
        assert os.sched_getscheduler(e._thread.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(p._thread.native_id) == os.SCHED_OTHER
    finally:
        host.stop()
