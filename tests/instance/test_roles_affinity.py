"""Roles → workers, mode → pools, and CPU core splitting / per-thread pinning."""
import os
import threading

import pytest
import torch

from epdserve.instance.affinity import parse_core_list, pin_worker_thread, thread_cores
from epdserve.platform.cores import split_cores
from epdserve.instance.modes import Pool, mode_pools
from epdserve.roles import normalize_roles, parse_roles


def test_worker_roles_coupled_and_colocated():
    assert parse_roles("EPD").workers == ("EPD",)
    assert parse_roles("pd").workers == ("PD",)
    assert parse_roles("PE").workers == ("E", "P")
    assert parse_roles("ED").workers == ("E", "D")
    assert parse_roles("D").workers == ("D",)
    assert parse_roles("P+E").workers == ("P+E",)  # one prefill engine that encodes inline (mode P-D)
    for bad in ("", "X", "EE", "E,P"):
        with pytest.raises(ValueError):
            normalize_roles(bad)


def test_mode_pools():
    assert mode_pools("monolithic", 1, 2, 1) == [Pool("EPD", 2)]
    assert mode_pools("E-P-D", 2, 1, 2) == [Pool("E", 2), Pool("P", 1), Pool("D", 2)]
    assert mode_pools("EP-D", 3, 1, 1) == [Pool("EP", 1), Pool("E", 2), Pool("D", 1)]
    assert mode_pools("ED-P", 1, 1, 2) == [Pool("ED", 2), Pool("P", 1)]
    assert mode_pools("E-PD", 1, 1, 1) == [Pool("E", 1), Pool("PD", 1)]
    assert mode_pools("P-D", 3, 2, 1) == [Pool("P+E", 2), Pool("D", 1)]  # no E instances: P encodes inline
    with pytest.raises(ValueError, match="role"):
        mode_pools("E-P-D", 1, 1, 0)
    with pytest.raises(ValueError, match="mode"):
        mode_pools("P-E-D")


def test_split_cores_disjoint_and_weighted():
    assert split_cores(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert split_cores(2, [0, 1, 2, 3, 4, 5, 6, 7], weights=[1, 3]) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert split_cores(3, [4, 5, 6]) == [[4], [5], [6]]
    assert split_cores(2, [0]) == [[0], [0]]  # fewer cores than workers: they share
    sets = split_cores(3, list(range(10)))
    assert sorted(c for s in sets for c in s) == list(range(10)) and all(sets)
    assert parse_core_list("0-2, 5,7-8") == [0, 1, 2, 5, 7, 8]
    with pytest.raises(ValueError):
        parse_core_list("3-1")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinned_worker_threads_keep_their_torch_teams_on_their_cores():
    """Each worker's intra-op OpenMP team inherits its worker's cores; the process is untouched."""
    process_cores = sorted(os.sched_getaffinity(0))
    sets = split_cores(2, process_cores)
    seen: dict[str, tuple[list[int], int]] = {}
    before = set(os.listdir("/proc/self/task"))

    def work(name, cores):
        got = pin_worker_thread(cores)
        a = torch.randn(256, 256)
        for _ in range(5):
            a = torch.tanh(a @ a)
        seen[name] = (got, torch.get_num_threads())

    threads = [threading.Thread(target=work, args=(f"w{i}", s)) for i, s in enumerate(sets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["w0"] == (sets[0], len(sets[0])) and seen["w1"] == (sets[1], len(sets[1]))
    assert thread_cores() == process_cores  # the main thread is not pinned
    # every thread born during the run (the workers' OpenMP teams) sits inside one worker's set
    for tid in set(os.listdir("/proc/self/task")) - before:
        try:
            cores = sorted(os.sched_getaffinity(int(tid)))
        except OSError:
            continue  # exited meanwhile
        assert cores in sets


def test_compute_id_names_what_an_instance_runs_on():
    import torch

    from epdserve.instance.affinity import compute_id, format_core_list

    assert format_core_list([6, 0, 1, 2, 3, 9, 10]) == "0-3,6,9-10"
    assert compute_id(torch.device("cpu"), None, "h") == "cpu@h"
    assert compute_id("cpu", [0, 1, 2, 3, 6], "h") == "cpu:0-3,6@h"  # pinned (launch --pin-instances)
    assert compute_id(torch.device("cuda", 1), None, "h") == "cuda:1@h"
    assert compute_id("npu", None, "h") == "npu:0@h"
