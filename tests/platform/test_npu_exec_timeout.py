"""HCCL_EXEC_TIMEOUT → how long a receive left running by a torn-down HCCL pair may still write
into its blocks (`NpuPlatform.stuck_work_bound_s`, issue 37 item 3). torch_npu reads the variable
with strtol and takes 0 as "never timeout" (OptionsManager.cpp GetHCCLExecTimeout,
ProcessGroupHCCL.cpp): 0, negative or not a plain integer → no bound (math.inf), and KVReceiver
then never hands the blocks back while the receive runs."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform.npu import NpuPlatform, exec_timeout_bound_s
from epdserve.transfer.kv import KVReceiver, KVTransferConfig, RecvRequest
from epdserve.transfer.kv.state import TransferState

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)


@pytest.mark.parametrize("value,bound", [(None, 1836 + 30), ("", 1836 + 30), ("600", 630), (" 45 ", 75),
                                         ("0", math.inf), ("-1", math.inf), ("abc", math.inf), ("0.5", math.inf),
                                         ("600s", math.inf)])
def test_the_bound_of_each_value(value, bound):
    assert exec_timeout_bound_s(value) == bound


def test_never_timing_out_means_the_blocks_are_never_released_while_the_receive_runs(monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "0")
    rx = KVReceiver(PagedKVCache(SPEC, 8), NpuPlatform(), KVTransferConfig())
    running = {"done": False}
    stuck = SimpleNamespace(is_completed=lambda: running["done"])
    exp = SimpleNamespace(req=RecvRequest("r", "p0", (1, 2), 8), state=TransferState.TRANSFERRING, error=None)
    rx._fail_accepted([exp], "pair broken", [stuck])
    time.sleep(0.01)
    assert rx.quarantined("r") and rx.pop_released() == []
    running["done"] = True  # the receive ended after all: now the blocks may go back
    assert rx.pop_released() == ["r"]


def test_the_kubernetes_npu_flavour_exports_a_finite_timeout():
    from epdserve.deploy.kube.flavours import FLAVOURS

    npu = [f for f in FLAVOURS.values() if "HCCL_EXEC_TIMEOUT" in f.env]
    assert npu and all(exec_timeout_bound_s(f.env["HCCL_EXEC_TIMEOUT"]) == 630 for f in npu)
