"""An instance on a real scheduler's roster: Register with its status, Heartbeat load, re-register
after the scheduler restarts (forgetting it), Deregister on stop; and, with no scheduler at all,
one warning per outage and a prompt stop however long the backoff has grown."""
from __future__ import annotations

import logging
import socket
import time

import grpc

from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.instance.registration import FIRST_BACKOFF_S, Registrar
from epdserve.rpc import common_pb2
from epdserve.rpc import serve_pb2, serve_pb2_grpc
from epdserve.rpc.servers import free_port
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security import Secret
from epdserve.security.interceptors import cluster_metadata
from epdserve.security.options import InstanceSecurity, SchedulerSecurity
from tests.instance.harness import wait_until

TOKEN = Secret("registration-test-token")


def roster(sched) -> dict:
    """instance id -> InstanceStatus, from the scheduler's public GetServerInfo (with the cluster
    token: only its holders see addresses)."""
    with grpc.insecure_channel(sched.address) as ch:
        info = serve_pb2_grpc.EPDServeStub(ch).GetServerInfo(serve_pb2.GetServerInfoRequest(), timeout=10,
                                                            metadata=cluster_metadata(TOKEN))
    return {i.instance_id: i for i in info.instances}


def test_register_heartbeat_reregister_deregister(qwen2_vl_tiny):
    port = free_port()
    cfg = dict(model=str(qwen2_vl_tiny), port=port, heartbeat_interval_s=0.2, probe_interval_s=0.2)
    security = SchedulerSecurity(cluster_token=TOKEN, internal_port=free_port())  # the restart keeps both ports
    sched = SchedulerThread(SchedulerConfig(**cfg), security=security)
    sched.start()
    host = None
    try:
        host = InstanceHost(InstanceConfig(roles="PD", model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address,
                                           kv_cache_bytes=2 << 20, block_size=32),
                            InstanceSecurity(cluster_token=TOKEN)).start()
        assert host.wait_registered(30)
        st = wait_until(lambda: roster(sched).get(host.instance_id), what="registration")
        assert st.roles == "PD" and st.address == f"127.0.0.1:{host.port}" and st.media_namespace
        assert st.load.total_kv_blocks > 0 and st.pid > 0
        assert st.block_size == 32  # its engine's: the router hashes prompts in blocks of it
        assert st.compute == f"cpu@{socket.gethostname()}"  # every core of this host: shared with its other instances
        sched.stop()  # a restarted scheduler knows nobody: the heartbeat says so and the instance registers again
        sched = SchedulerThread(SchedulerConfig(**cfg), security=security)
        sched.start()
        wait_until(lambda: host.instance_id in roster(sched), what="registration with the new scheduler")
        host.stop()
        wait_until(lambda: host.instance_id not in roster(sched), what="deregistration")
        host = None
    finally:
        if host is not None:
            host.stop()
        sched.stop()


def test_unreachable_scheduler_warns_once_and_stop_cuts_the_backoff_short(caplog):
    caplog.set_level(logging.INFO, logger="epdserve.instance.registration")
    status = common_pb2.InstanceStatus(instance_id="i0", roles="PD", address="127.0.0.1:1")
    calls = []  # one per Register attempt: each reads the status first

    def counted():
        calls.append(time.monotonic())
        return status

    reg = Registrar(f"127.0.0.1:{free_port()}", counted, rpc_timeout_s=0.5, max_backoff_s=60.0).start()
    try:
        wait_until(lambda: any("unreachable" in r.getMessage() for r in caplog.records), what="the warning")
        # the k-th wait is FIRST_BACKOFF_S * 2**k: after 7 calls the pending one (>= 3.2 s) outlasts
        # stop()'s join of the registering thread (rpc_timeout_s + 1 s), so the thread is gone after
        # stop() only if stop() cut that wait short
        wait_until(lambda: len(calls) >= 7, what="enough failed calls that the backoff outlasts stop's join")
        assert FIRST_BACKOFF_S * 2 ** 6 > reg.rpc_timeout_s + 1.0
    finally:
        reg.stop()
    assert not reg._thread.is_alive() and not reg.registered.is_set()
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1


def test_a_refused_registration_is_logged_once_with_the_reason_and_joins_when_the_conflict_leaves(
        qwen2_vl_tiny, caplog):
    """A D whose KV layout cannot pair with the registered P is refused (FAILED_PRECONDITION): the
    instance logs the scheduler's reason once, as an error (not as "unreachable"), keeps retrying,
    and joins once the P has left."""
    caplog.set_level(logging.INFO, logger="epdserve.instance.registration")
    sched = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), port=free_port()))
    sched.start()
    layout = dict(degree=1, num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")

    def st(iid, roles, **kw):
        return common_pb2.InstanceStatus(instance_id=iid, roles=roles, address=f"127.0.0.1:{free_port()}",
                                         kv_layout=common_pb2.KvLayout(**{**layout, **kw}))

    p, d = st("p0", "P"), st("d0", "D", quantization="int8")
    calls = []
    p_reg = Registrar(sched.server.internal_address, lambda: p, max_backoff_s=0.2).start()
    d_reg = None
    try:
        assert p_reg.registered.wait(30)
        d_reg = Registrar(sched.server.internal_address, lambda: calls.append(1) or d, max_backoff_s=0.2).start()
        wait_until(lambda: len(calls) >= 4, what="several refused attempts")
        assert not d_reg.registered.is_set()
        refusals = [r for r in caplog.records if "refused to register" in r.getMessage()]
        assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR
        assert "d0 cannot pair with p0" in refusals[0].getMessage() and "weights int8" in refusals[0].getMessage()
        assert not any("unreachable" in r.getMessage() for r in caplog.records)
        p_reg.stop()  # deregisters: the conflict is gone
        assert d_reg.registered.wait(30)
    finally:
        p_reg.stop()
        if d_reg is not None:
            d_reg.stop()
        sched.stop()
