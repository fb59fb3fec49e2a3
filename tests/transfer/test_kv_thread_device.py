"""Every thread of a KV pair selects the pair's device before touching it (torch_npu and CUDA keep
the current device per thread): the group-building thread of both sides, P's waiter and D's
receiver. Real gloo pair on loopback; the CPU platform subclass only records who asked."""
import threading
import time

import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform.cpu import CpuPlatform
from epdserve.transfer.kv import KVReceiver, KVSender, KVTransferConfig, PairState, RendezvousServer


class RecordingCpu(CpuPlatform):
    def __init__(self):
        self.threads: list[str] = []

    def set_thread_device(self, index: int = 0) -> None:
        self.threads.append(threading.current_thread().name)


def test_pair_threads_select_their_device():
    spec = KVCacheSpec(2, 2, 8, 4, torch.float32)
    cfg = KVTransferConfig(timeout_s=10, bootstrap_timeout_s=10, connect_timeout_s=10)
    plat = RecordingCpu()
    server = RendezvousServer()
    tx, rx = KVSender(PagedKVCache(spec, 4), plat, cfg), KVReceiver(PagedKVCache(spec, 4), plat, cfg)
    try:
        rdzv = server.rendezvous("p0>d0/g0")
        tx.connect("d0", rdzv)
        rx.connect("p0", rdzv.for_peer())
        deadline = time.monotonic() + 20
        while tx.pair_state("d0") is not PairState.READY or rx.pair_state("p0") is not PairState.READY:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        names = set(plat.threads)
        assert "kv-connect:p0>d0/g0" in names and plat.threads.count("kv-connect:p0>d0/g0") == 2
        assert "kv-send:d0" in names and "kv-recv:p0" in names
    finally:
        tx.close()
        rx.close()
        server.close()
