"""Contract test of the HCCL path, on CPU: a recording stand-in for torch_npu (injected only
here) pins the calls the KV hop makes through `platform/npu.py` — the ProcessGroupHCCL
constructor and Options._timeout, send/recv names, ranks, tags and uint8 payloads, their order
on both sides (HCCL ignores tags and cannot receive from any source), waits with our timeout,
and abort() to break a pair. The rendezvous store is real.
"""
from __future__ import annotations

import sys
import time
import types
from datetime import timedelta

import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform.npu import NpuPlatform
from epdserve.transfer.kv import (
    KVReceiver, KVSender, KVTransferConfig, RecvRequest, RendezvousServer, SendRequest, TransferState,
)

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)
CFG = KVTransferConfig(timeout_s=7.0, bootstrap_timeout_s=10.0, connect_timeout_s=11.0)


def fake_torch_npu(log: list):
    """A torch_npu with just `_C._distributed_c10d.ProcessGroupHCCL`, logging every call."""

    class Options:
        def __init__(self):
            log.append(("Options",))

        def __setattr__(self, name, value):
            log.append(("Options.set", name, value))
            object.__setattr__(self, name, value)

    class Work:
        def __init__(self, rank):
            self.rank = rank

        def wait(self, timeout=timedelta(0)):
            log.append((self.rank, "wait", timeout))
            return True

    class ProcessGroupHCCL:
        def __init__(self, store, rank, size, options):
            log.append(("ProcessGroupHCCL", type(store).__name__, rank, size, options))
            self.rank = rank

        def _set_sequence_number_for_group(self):
            log.append((self.rank, "_set_sequence_number_for_group"))

        def send(self, tensors, dst_rank, tag):
            (t,) = tensors
            log.append((self.rank, "send", dst_rank, tag, t.dtype, t.numel()))
            return Work(self.rank)

        def recv(self, tensors, src_rank, tag):
            (t,) = tensors
            log.append((self.rank, "recv", src_rank, tag, t.dtype, t.numel()))
            if t.numel() == 1:  # the acknowledgement: "stored"
                t.fill_(1)
            return Work(self.rank)

        def recv_anysource(self, *a):
            log.append((self.rank, "recv_anysource"))
            raise RuntimeError("HCCL cannot receive from any source")

        def abort(self):
            log.append((self.rank, "abort"))

    ProcessGroupHCCL.Options = Options
    mod = types.ModuleType("torch_npu")
    mod._C = types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(ProcessGroupHCCL=ProcessGroupHCCL))
    # torch_npu/npu/utils.py set_device(device): the calling thread's current device
    mod.npu = types.SimpleNamespace(set_device=lambda index: log.append(("set_device", index)))
    return mod


def test_hccl_calls_names_arguments_and_order(monkeypatch):
    log: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(log))
    npu = NpuPlatform()
    server = RendezvousServer()
    tx, rx = KVSender(PagedKVCache(SPEC, 8), npu, CFG), KVReceiver(PagedKVCache(SPEC, 8), npu, CFG)
    try:
        rdzv = server.rendezvous("p0-d0/g0")
        assert tx.connect("d0", rdzv).wait_ready(10) and rx.connect("p0", rdzv.for_peer()).wait_ready(10)

        ctors = [e for e in log if e[0] == "ProcessGroupHCCL"]
        assert sorted((c[1], c[2], c[3]) for c in ctors) == [("PrefixStore", 0, 2), ("PrefixStore", 1, 2)]
        assert log.count(("Options",)) == 2
        assert ("Options.set", "_timeout", timedelta(seconds=CFG.connect_timeout_s + CFG.timeout_s)) in log
        for c in ctors:  # the options handed to the constructor carry the timeout and a per-pair group id
            assert c[4]._timeout == timedelta(seconds=CFG.connect_timeout_s + CFG.timeout_s)
            assert c[4].group_id == "epdserve-kv/p0-d0/g0"
            assert c[4].is_high_priority_stream is False and c[4].global_ranks_in_group == []
        assert sorted(e[0] for e in log if e[1:] == ("_set_sequence_number_for_group",)) == [0, 1]
        first_ctor = log.index(ctors[0])
        assert log[:first_ctor].count(("set_device", 0)) >= 1  # a pair thread selects its device before HCCL

        rx.expect(RecvRequest("r", "p0", (1, 2, 6), 10))  # two chunks on D: blocks 1-2, then 6
        tx.begin_batch([SendRequest("r", "d0", (5, 0, 3), (1, 2, 6), 10)])
        for layer in range(SPEC.num_layers):
            tx.save_layer(layer)
        deadline = time.monotonic() + 10
        while not (tx.status("r").state.finished and rx.status("r").state.finished):
            assert time.monotonic() < deadline, "transfer did not finish"
            time.sleep(0.005)
        assert tx.status("r").state is rx.status("r").state is TransferState.DONE
    finally:
        tx.close()
        rx.close()
        server.close()

    block_bytes = SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim * 2
    per_layer = [2 * block_bytes, 2 * block_bytes, block_bytes, block_bytes]  # K, V of chunk 1; K, V of chunk 2
    p_ops = [e[1:] for e in log if e[0] == 0 and e[1] in ("send", "recv", "recv_anysource")]
    d_ops = [e[1:] for e in log if e[0] == 1 and e[1] in ("send", "recv", "recv_anysource")]
    assert p_ops == [("send", 1, 0, torch.uint8, n) for n in per_layer * SPEC.num_layers] + [("recv", 1, 0, torch.uint8, 1)]
    assert d_ops == [("recv", 0, 0, torch.uint8, n) for n in per_layer * SPEC.num_layers] + [("send", 0, 0, torch.uint8, 1)]
    waits = [e for e in log if len(e) == 3 and e[1] == "wait"]
    assert len(waits) == len(p_ops) + len(d_ops)
    assert {w[2] for w in waits} == {timedelta(seconds=CFG.timeout_s)}
    assert (0, "abort") in log and (1, "abort") in log  # close() breaks HCCL pairs with abort()
    assert log.count(("set_device", 0)) == 4  # both group builders, P's waiter, D's receiver


def test_without_torch_npu_the_npu_pair_fails_cleanly(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    server = RendezvousServer()
    tx = KVSender(PagedKVCache(SPEC, 8), NpuPlatform(), CFG)
    try:
        pair = tx.connect("d0", server.rendezvous("x"))
        assert pair.wait_ready(10) is False
        assert "could not build the process group (hccl" in pair.error
    finally:
        tx.close()
        server.close()
