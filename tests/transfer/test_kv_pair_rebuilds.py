"""Pair rebuilds are capped per prefill peer (`KVTransferConfig.max_pair_rebuilds` within
`pair_rebuild_window_s`): a D whose pair with one P keeps breaking stops rebuilding it, refuses
that peer's requests as retryable (`PairRebuildsExhausted`; the decode worker turns it into a
TransientError: gRPC ABORTED, the scheduler reroutes), logs why once, and builds again once the
oldest rebuild has left the window. Real gloo pairs on loopback: the P side never comes (each
pair breaks at its connect timeout), then comes and carries KV."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.instance.config import InstanceConfig
from epdserve.instance.errors import TransientError, status_for
from epdserve.platform.cpu import CpuPlatform
from epdserve.transfer.kv import KVSender, KVTransferConfig, PairState, RendezvousServer, SendRequest, TransferState
from epdserve.transfer.kv.recv_connector import LayerwiseRecvConnector, PairRebuildsExhausted
from epdserve.transfer.kv.receiver import RecvRequest
from tests.harness import wait_until

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
WINDOW_S = 8.0  # a pair whose P never comes breaks after connect_timeout_s + timeout_s (0.7 s)
CFG = KVTransferConfig(timeout_s=0.5, bootstrap_timeout_s=10.0, connect_timeout_s=0.2, max_pair_rebuilds=2,
                       pair_rebuild_window_s=WINDOW_S)


def _broken(conn: LayerwiseRecvConnector, peer: str = "p0") -> None:
    wait_until(lambda: conn.receiver.pair_state(peer) is PairState.BROKEN, 10.0, "the pair did not break")


def test_a_peer_whose_pair_keeps_breaking_is_refused_until_the_window_passes(caplog):
    server = RendezvousServer()
    conn = LayerwiseRecvConnector("d0", CFG)
    conn.register_kv_cache(PagedKVCache(SPEC, 8), CpuPlatform())
    tx = None
    try:
        first = conn.pair_for("p0", server.host, server.port)  # the first build is no rebuild
        _broken(conn)
        start = time.monotonic()  # before the first rebuild
        names = [first.pair_name]
        for _ in range(CFG.max_pair_rebuilds):  # two rebuilds are allowed ...
            names.append(conn.pair_for("p0", server.host, server.port).pair_name)
            _broken(conn)
        assert names == ["p0>d0/g0", "p0>d0/g1", "p0>d0/g2"]
        with caplog.at_level(logging.WARNING, logger="epdserve.transfer.kv.recv_connector"):
            for _ in range(3):  # ... the third is refused, every time, with nothing built
                with pytest.raises(PairRebuildsExhausted, match=r"rebuilt 2 times in the last 8 s \(limit 2"):
                    conn.pair_for("p0", server.host, server.port)
        assert conn.receiver.pair_state("p0") is PairState.BROKEN
        assert conn._pairs["p0"].pair_name == "p0>d0/g2"
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and "could not build the process group" in warned[0], warned  # once, and why

        # Once the first rebuild leaves the window, the pair is built again, and this time P comes.
        wait_until(lambda: time.monotonic() - start > WINDOW_S + 0.2, WINDOW_S + 5, "")
        rdzv = conn.pair_for("p0", server.host, server.port)
        assert rdzv.pair_name == "p0>d0/g3"
        tx = KVSender(PagedKVCache(SPEC, 8), CpuPlatform(), CFG)
        tx.cache.keys[0].fill_(3.0)
        tx.connect("d0", rdzv.for_peer())
        wait_until(lambda: conn.receiver.pair_state("p0") is PairState.READY, 10.0, "the rebuilt pair did not connect")
        conn.receiver.expect(RecvRequest("r", "p0", (1, 2), 8))
        tx.begin_batch([SendRequest("r", "d0", (3, 4), (1, 2), 8)])
        for layer in range(SPEC.num_layers):
            tx.save_layer(layer)
        wait_until(lambda: conn.receiver.status("r").state.finished, 10.0, "the transfer did not finish")
        assert conn.receiver.status("r").state is TransferState.DONE
        assert torch.equal(conn.receiver.cache.keys[0][1:3], tx.cache.keys[0][3:5])
        # A healthy pair is reused: no rebuild counted.
        assert conn.pair_for("p0", server.host, server.port) is rdzv
    finally:
        if tx is not None:
            tx.close()
        conn.close()
        server.close()


def test_the_cap_is_an_instance_setting_passed_to_the_pairs():
    cfg = InstanceConfig(roles="D", model="m")
    assert (cfg.kv_pair_rebuilds, cfg.kv_pair_rebuild_window_s) == (8, 600.0)
    assert (KVTransferConfig().max_pair_rebuilds, KVTransferConfig().pair_rebuild_window_s) == (8, 600.0)
    with pytest.raises(ValueError, match="kv_pair_rebuilds"):
        InstanceConfig(roles="D", model="m", kv_pair_rebuilds=-1)
    with pytest.raises(ValueError, match="max_pair_rebuilds"):
        KVTransferConfig(max_pair_rebuilds=1.5)
    with pytest.raises(ValueError, match="pair_rebuild_window_s"):
        KVTransferConfig(pair_rebuild_window_s=0)


def test_the_decode_worker_fails_a_capped_peer_as_retryable(qwen2_vl_tiny):
    """A real D worker (tiny demo model, CPU): `reserve` for a P whose pair keeps breaking raises
    TransientError once the cap is reached — gRPC ABORTED, which the scheduler retries elsewhere."""
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.llm_engine import LLMEngine
    from epdserve.engine.sampling_params import SamplingParams
    from epdserve.instance.decode_worker import DecodeWorker

    cfg = KVTransferConfig(timeout_s=0.5, bootstrap_timeout_s=10.0, connect_timeout_s=0.2, max_pair_rebuilds=1,
                           pair_rebuild_window_s=60.0)
    server = RendezvousServer()
    worker = DecodeWorker("D-worker", lambda c: LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", roles="D",
                                                                       kv_cache_bytes=4 << 20), kv_connector=c),
                          instance_id="d0", kv_config=cfg).start()
    try:
        worker.wait_ready(120)
        params = SamplingParams(max_tokens=2)
        for i in range(2):  # the first build, then the one rebuild allowed
            _, res = worker.reserve(f"r{i}", [1, 2, 3, 4, 5], params, "p0", server.host, server.port)
            assert res.rdzv.pair_name == f"p0>d0/g{i}"
            wait_until(lambda: worker.connector.receiver.pair_state("p0") is PairState.BROKEN, 10.0, "the pair did not break")
        with pytest.raises(TransientError, match="rebuilt 1 times in the last 60 s") as e:
            worker.reserve("r2", [1, 2, 3, 4, 5], params, "p0", server.host, server.port)
        assert status_for(e.value).name == "ABORTED"
        assert "r2" not in worker.handles
    finally:
        worker.stop()
        server.close()
