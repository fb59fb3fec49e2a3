"""What a stuck HCCL receive leaves behind, counted and acted on. Over tests/fakes/torch_npu_fake.py,
whose destroy follows CANN's contract (tests/fakes/hccl_destroy.py): HcclCommDestroy returns
HCCL_E_AGAIN while D's receive runs, torch_npu ignores it and drops the handle, so that
communicator is left behind until the process ends.

- leaked communicators: the pair whose teardown left a receive running counts once in the D
  connector's `TransferCounters.leaked_communicators`, travels in `Load.kv_leaked_communicators`
  and is exported by the scheduler as ``epdserve:instance_kv_leaked_communicators_total``; a
  gloo pair (no communicator to leak: its interrupt ends every pending op) counts nothing.
- HCCL_EXEC_TIMEOUT=0 ("never"): the stuck receive's blocks are quarantined with no bound, and the
  instance asks for a restart: health NOT_SERVING, draining, and `epdserve instance`'s loop stops
  with RESTART_EXIT_CODE (which the launcher's supervisor restarts, as it does any exit).
"""
from __future__ import annotations

import threading
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.entrypoints.instance_cli import serve_until_stopped
from epdserve.instance.config import InstanceConfig
from epdserve.instance.decode_worker import DecodeWorker
from epdserve.deploy.local.supervisor import RESTART_EXIT_CODE
from epdserve.instance.host import InstanceHost
from epdserve.instance.worker import _add_counters
from epdserve.metrics.roster import RosterCollector
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.npu import NpuPlatform
from epdserve.rpc import INSTANCE_SERVICE, common_pb2
from epdserve.rpc.servers import add_health_and_reflection, set_serving
from epdserve.scheduler.registry import InstanceRegistry
from epdserve.seams.kv_connector import RemotePrefill
from epdserve.transfer.kv import KVSender, KVTransferConfig, PairState, RendezvousServer, SendRequest, TransferState
from epdserve.transfer.kv.recv_connector import LayerwiseRecvConnector
from tests.fakes.hccl_destroy import HCCL_E_AGAIN
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.harness import wait_until

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)
CFG = KVTransferConfig(timeout_s=1.0, bootstrap_timeout_s=10.0, connect_timeout_s=10.0)
STATS = {"steps": 0, "host_s": 0.0, "forward_s": 0.0, "vision_s": 0.0, "batch_requests": 0}


class _Stalled:
    """A D connector over real pairs with one transfer stalled: P publishes the batch header and
    never sends a layer, D's receives time out and D tears the pair down while they are posted."""

    def __init__(self, platform, spec=SPEC):
        self.server = RendezvousServer()
        self.conn = LayerwiseRecvConnector("d0", CFG)
        self.conn.register_kv_cache(PagedKVCache(spec, 8), platform)
        self.tx = KVSender(PagedKVCache(spec, 8), platform, CFG)
        rdzv = self.conn.pair_for("p0", self.server.host, self.server.port)
        pair = self.tx.connect("d0", rdzv.for_peer())
        assert pair.wait_ready(10), pair.error
        wait_until(lambda: self.conn.receiver.pair_state("p0") is PairState.READY, 10.0, "D's pair did not connect")
        seq = SimpleNamespace(request_id="stalled", prompt_len=8, num_computed_tokens=0,
                          handoff=SimpleNamespace(kv_transfer=RemotePrefill("p0")))
        self.conn.on_blocks_allocated(seq, [1, 2, 3])
        self.tx.begin_batch([SendRequest("stalled", "d0", (3, 4), (1, 2), 8)])  # and never a layer
        self.failed = []
        wait_until(self._failed, 10.0, "the stalled transfer did not fail")
        self.tx.abort_batch("peer stalled")

    def _failed(self) -> bool:
        self.failed += self.conn.get_finished()[1]
        return bool(self.failed)

    def close(self) -> None:
        self.tx.close()
        self.conn.close()
        self.server.close()


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_HCCL_HIGH_PRIORITY", raising=False)
    fake = FakeTorchNpu().install(monkeypatch)
    fake.exec_timeout_s = 60.0  # longer than the test: the receive stays stuck
    return fake


def _scrape(load: common_pb2.Load, roles: str) -> float:
    registry = InstanceRegistry()
    registry.register(common_pb2.InstanceStatus(instance_id="d0", roles=roles, address="127.0.0.1:1", load=load))
    prom = CollectorRegistry()
    prom.register(RosterCollector(SimpleNamespace(registry=registry)))
    for family in text_string_to_metric_families(generate_latest(prom).decode()):
        for s in family.samples:
            if s.name == "epdserve:instance_kv_leaked_communicators_total" and s.labels["instance"] == "d0":
                return s.value
    raise AssertionError("no epdserve:instance_kv_leaked_communicators_total for d0")


def test_a_destroy_that_returned_e_again_counts_one_leaked_communicator_up_to_the_scheduler(fake, monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "600")
    npu = NpuPlatform()
    npu.set_thread_device(0)
    run = _Stalled(npu)
    try:
        assert [f.request_id for f in run.failed] == ["stalled"]
        assert (1, HCCL_E_AGAIN) in [e[2:] for e in fake.of("HcclCommDestroy")]  # D's destroy could not complete
        assert run.conn.receiver.quarantined("stalled")
        assert run.conn.counters.leaked_communicators == 1
        run.conn.receiver._channels["p0"].pair.interrupt()  # a second teardown of the same pair: not counted again
        run.conn.get_finished()
        assert run.conn.counters.leaked_communicators == 1
        assert run.conn.restart_reason() is None  # bounded: 600 s, the quarantine ends by itself

        load = common_pb2.Load()
        _add_counters(load, STATS, run.conn.counters, "D")
        assert load.kv_leaked_communicators == 1
        assert _scrape(load, "D") == 1.0
    finally:
        run.close()


def test_a_gloo_pair_broken_mid_receive_leaks_nothing():
    run = _Stalled(CpuPlatform(), KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4,
                                              dtype=torch.float32))
    try:
        assert [f.request_id for f in run.failed] == ["stalled"]
        assert not run.conn.receiver.quarantined("stalled")
        assert run.conn.counters.leaked_communicators == 0 and run.conn.restart_reason() is None
    finally:
        run.close()


def test_an_unbounded_quarantine_turns_the_instance_not_serving_and_stops_it_for_a_restart(fake, monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "0")  # CANN: never time out
    npu = NpuPlatform()
    npu.set_thread_device(0)
    run = _Stalled(npu)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    host = InstanceHost(InstanceConfig(roles="D", model="m"))
    try:
        rx = run.conn.receiver
        assert rx.quarantined("stalled") and rx.pop_released() == []  # never released by a bound
        why = run.conn.restart_reason()
        assert why is not None and "stalled" in why and "HCCL_EXEC_TIMEOUT='0'" in why

        # The instance process: a D worker holding that connector, the gRPC health service.
        worker = DecodeWorker("D-worker", None, instance_id="d0", kv_config=CFG)
        worker.connector = run.conn
        host.workers = [worker]
        host._health = add_health_and_reflection(server, [INSTANCE_SERVICE])
        server.start()
        set_serving(host._health, [INSTANCE_SERVICE], True)
        stop = threading.Event()
        assert serve_until_stopped(host, stop, check_s=0.02) == RESTART_EXIT_CODE
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", INSTANCE_SERVICE):
                answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING, service
        assert host.status().draining  # the next heartbeat stops new work at once
        assert rx.quarantined("stalled")  # the blocks stay held until the process ends
    finally:
        server.stop(0)
        run.close()


def test_without_a_reason_the_instance_serves_until_signalled():
    host = InstanceHost(InstanceConfig(roles="D", model="m"))
    conn = LayerwiseRecvConnector("d0", CFG)  # no KV cache registered yet: nothing held
    worker = DecodeWorker("D-worker", None, instance_id="d0", kv_config=CFG)
    worker.connector = conn
    host.workers = [worker]
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert serve_until_stopped(host, stop, check_s=0.02) == 0
    assert host.check_restart() is None and not host.draining
