"""P→D KV transfer across real processes: 1 P + 1 D, 1 P + 2 D, peer death and stall, pair
rebuild — on gloo (loopback), and on HCCL's semantics through tests/fakes/torch_npu_fake.py
(non-blocking waits, lazy communicator, abort_hccl_comm, a teardown watchdog) over gloo.

The peers are this file's `_decode_peer` / `_prefill_peer`, run as `python -c` subprocesses
that take JSON commands on stdin and report JSON events on stdout (no pickling). Block ids
come from each side's own BlockManager, as in the engine: D reserves, tells P (through this
test), P sends; both sides free their blocks when a transfer finishes.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from epdserve.engine.block_manager import BlockManager
from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform import get_platform
from epdserve.platform.npu import NpuPlatform
from epdserve.transfer.kv import (
    KVReceiver, KVSender, KVTransferConfig, PairRendezvous, PairState, RecvRequest, RendezvousServer, SendRequest,
    TransferState,
)
from epdserve.transfer.kv.checks import blocks_digest, fill_random
from tests.fakes.torch_npu_fake import FakeTorchNpu

REPO = Path(__file__).resolve().parents[2]
SPEC = dict(num_layers=6, num_kv_heads=2, head_dim=16, block_size=8, dtype="bfloat16")
NUM_BLOCKS = 64
TIMEOUT_S = 3.0
BACKEND_ENV = "EPDSERVE_TEST_KV_BACKEND"  # gloo | fake-hccl, inherited by the peer processes
CFG_ENV = "EPDSERVE_TEST_KV_CFG"  # JSON KVTransferConfig overrides, inherited too


@pytest.fixture(params=["gloo", "fake-hccl"], autouse=True)
def backend(request, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, request.param)
    if request.param == "fake-hccl":
        monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", "-")  # recorded, so what epdserve sets is undone
        monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING")
        FakeTorchNpu().install(monkeypatch)
    return request.param


def _platform():
    """This process's platform for the KV hop: the CPU's gloo, or the NPU's over the fake torch_npu."""
    if os.environ.get(BACKEND_ENV, "gloo") == "gloo":
        return get_platform("cpu")
    if "torch_npu" not in sys.modules:  # a peer process (the test process installed it already)
        FakeTorchNpu().install()
    return NpuPlatform()


def _spec() -> KVCacheSpec:
    return KVCacheSpec(**{**SPEC, "dtype": getattr(torch, SPEC["dtype"])})


def _cfg(**kw) -> KVTransferConfig:
    overrides = json.loads(os.environ.get(CFG_ENV, "{}"))  # a test's own timeouts, for peers too
    return KVTransferConfig(**{"timeout_s": TIMEOUT_S, "bootstrap_timeout_s": 30.0, "connect_timeout_s": 30.0,
                               **overrides, **kw})


# ---------------------------------------------------------------------------- peer processes
def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def _commands() -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def read():
        for line in sys.stdin:
            q.put(json.loads(line))
        q.put({"cmd": "quit"})

    threading.Thread(target=read, daemon=True).start()
    return q


def _engine_commands(rx):
    """A decode-engine peer's command loop: says "up", answers `connect` (a pair to P's rendezvous),
    closes `rx` and ends at `quit`; yields every other command, or {"cmd": None} when none came
    within 2 ms (the peer steps its engine either way)."""
    cmds = _commands()
    _emit(event="up")
    while True:
        try:
            cmd = cmds.get(timeout=0.002)
        except queue.Empty:
            cmd = {"cmd": None}
        if cmd["cmd"] == "quit":
            rx.close()
            return
        if cmd["cmd"] == "connect":
            rdzv = PairRendezvous.from_json(cmd["rdzv"])
            _emit(event="connecting", pair_name=rx.pair_for("p0", rdzv.host, rdzv.port).pair_name)
        yield cmd


def _decode_peer() -> None:
    """A decode instance: reserves blocks on `expect`, receives, reports digests, frees blocks."""
    cache = PagedKVCache(_spec(), NUM_BLOCKS)
    blocks = BlockManager(NUM_BLOCKS, SPEC["block_size"])
    rx = KVReceiver(cache, _platform(), _cfg())
    cmds, progress = _commands(), {}
    while True:
        try:
            cmd = cmds.get(timeout=0.005)
        except queue.Empty:
            cmd = None
        if cmd and cmd["cmd"] == "quit":
            rx.close()
            return
        if cmd and cmd["cmd"] == "connect":
            pair = rx.connect("p0", PairRendezvous.from_json(cmd["rdzv"]))
            _emit(event="ready" if pair.wait_ready(30) else "connect_failed", error=pair.error)
        if cmd and cmd["cmd"] == "expect":
            rid, n = cmd["request_id"], cmd["num_tokens"]
            ids = tuple(blocks.grow(rid, n))
            rx.expect(RecvRequest(rid, "p0", ids, n))
            progress[rid] = 0
            _emit(event="reserved", request_id=rid, blocks=list(ids))
        for rid in list(progress):
            st = rx.status(rid)
            if st is not None and st.layers_done > progress[rid]:
                progress[rid] = st.layers_done
                _emit(event="progress", request_id=rid, layers_done=st.layers_done)
        for st in rx.pop_finished():
            progress.pop(st.request_id, None)
            digest = blocks_digest(cache, blocks.table(st.request_id)) if st.state is TransferState.DONE else None
            blocks.free(st.request_id)
            _emit(event="finished", request_id=st.request_id, state=st.state.value, error=st.error,
                  digest=digest, num_free=blocks.num_free, pair=rx.pair_state("p0").value)


def _prefill_peer() -> None:
    """A prefill instance that can stall midway: sends what it is told, reports the outcome."""
    cache = PagedKVCache(_spec(), NUM_BLOCKS)
    blocks = BlockManager(NUM_BLOCKS, SPEC["block_size"])
    server = RendezvousServer()
    tx = KVSender(cache, _platform(), _cfg())
    cmds = _commands()
    while True:
        cmd = cmds.get(timeout=60)
        if cmd["cmd"] == "quit":
            tx.close()
            return
        if cmd["cmd"] == "connect":
            rdzv = server.rendezvous(cmd["pair_name"])
            _emit(event="rdzv", rdzv=rdzv.for_peer().to_json())
            pair = tx.connect("d0", rdzv)
            _emit(event="ready" if pair.wait_ready(30) else "connect_failed", error=pair.error)
        if cmd["cmd"] == "send":
            rid, n = cmd["request_id"], cmd["num_tokens"]
            src = tuple(blocks.grow(rid, n))
            tx.begin_batch([SendRequest(rid, "d0", src, tuple(cmd["dst"]), n)])
            for layer in range(SPEC["num_layers"]):
                fill_random(cache, layer, src, cmd["seed"])
                if layer == cmd.get("stall_after"):
                    _emit(event="stalling")
                    time.sleep(cmd["stall_s"])
                tx.save_layer(layer)
            st = _finish(tx, {rid})[rid]
            digest = blocks_digest(cache, src)
            blocks.free(rid)
            _emit(event="finished", request_id=rid, state=st.state.value, error=st.error, digest=digest,
                  num_free=blocks.num_free, pair=tx.pair_state("d0").value)


class Peer:
    """A peer subprocess: JSON commands in, JSON events out, every wait bounded."""

    def __init__(self, main: str, module: str = __name__, argv: tuple[str, ...] = ()):
        code = f"from {module} import {main}; {main}()"
        self.proc = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.events: queue.Queue = queue.Queue()
        self.backlog: list[dict] = []  # events read while waiting for another one
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(self, event: str, timeout_s: float = 30.0, **match) -> dict:
        def matches(ev):
            return ev["event"] == event and all(ev.get(k) == v for k, v in match.items())

        for ev in self.backlog:
            if matches(ev):
                self.backlog.remove(ev)
                return ev
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {event!r} event {match} within {timeout_s}s")
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if matches(ev):
                return ev
            self.backlog.append(ev)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def _finish(side, ids: set[str], timeout_s: float = 20.0) -> dict:
    out: dict = {}
    deadline = time.monotonic() + timeout_s
    while set(out) != ids:
        for st in side.pop_finished():
            out[st.request_id] = st
        if time.monotonic() > deadline:
            raise AssertionError(f"transfers {ids - set(out)} not finished within {timeout_s}s")
        time.sleep(0.005)
    return out


class Prefill:
    """This test process as a prefill instance."""

    def __init__(self):
        self.cache = PagedKVCache(_spec(), NUM_BLOCKS)
        self.blocks = BlockManager(NUM_BLOCKS, SPEC["block_size"])
        self.server = RendezvousServer()
        self.tx = KVSender(self.cache, _platform(), _cfg())

    def connect(self, peer_name: str, peer: Peer, pair_name: str) -> None:
        rdzv = self.server.rendezvous(pair_name)
        pair = self.tx.connect(peer_name, rdzv)
        peer.send(cmd="connect", rdzv=rdzv.for_peer().to_json())
        assert pair.wait_ready(30), pair.error
        peer.wait("ready")

    def run_batch(self, reqs: list[tuple[str, str, int, list[int]]], layer_pause_s: float = 0.0, on_layer=None):
        """reqs: (request_id, peer, num_tokens, dst blocks). Fills each layer, then sends it."""
        send = [SendRequest(rid, peer, tuple(self.blocks.grow(rid, n)), tuple(dst), n) for rid, peer, n, dst in reqs]
        self.tx.begin_batch(send)
        for layer in range(SPEC["num_layers"]):
            for i, r in enumerate(send):
                fill_random(self.cache, layer, r.src_block_ids, seed=i + 1)
            self.tx.save_layer(layer)
            if on_layer:
                on_layer(layer)
            time.sleep(layer_pause_s)  # stands for the next layer's compute
        return {r.request_id: blocks_digest(self.cache, r.src_block_ids) for r in send}

    def finish(self, ids: set[str]) -> dict:
        out = _finish(self.tx, ids)
        for rid in ids:
            self.blocks.free(rid)  # the owner frees once the transfer finished, either way
        return out

    def close(self):
        self.tx.close()
        self.server.close()


def _expect(d: Peer, rid: str, n: int) -> list[int]:
    d.send(cmd="expect", request_id=rid, num_tokens=n)
    return d.wait("reserved", request_id=rid)["blocks"]


# ---------------------------------------------------------------------------- tests
def test_one_prefill_one_decode_bit_exact_over_two_batches():
    p, d = Prefill(), Peer("_decode_peer")
    try:
        p.connect("d0", d, "p0-d0/g0")
        for batch in ([("a", 37), ("b", 8)], [("c", 300)]):
            reqs = [(rid, "d0", n, _expect(d, rid, n)) for rid, n in batch]
            digests = p.run_batch(reqs)
            ids = {rid for rid, _ in batch}
            assert all(st.state is TransferState.DONE for st in p.finish(ids).values())
            for rid in ids:
                ev = d.wait("finished", request_id=rid)
                assert ev["state"] == "done" and ev["digest"] == digests[rid]
        assert ev["num_free"] == NUM_BLOCKS and p.blocks.num_free == NUM_BLOCKS
    finally:
        d.stop()
        p.close()


def test_killing_one_decode_midway_fails_it_and_the_other_decode_keeps_serving():
    p, d1, d2 = Prefill(), Peer("_decode_peer"), Peer("_decode_peer")
    d1_new = None
    try:
        p.connect("d1", d1, "p0-d1/g0")
        p.connect("d2", d2, "p0-d2/g0")
        reqs = [("r1", "d1", 60, _expect(d1, "r1", 60)), ("r2", "d2", 60, _expect(d2, "r2", 60))]

        def kill_d1_once_it_has_data(layer):
            if layer == 1:
                d1.wait("progress", request_id="r1")
                d1.kill()

        digests = p.run_batch(reqs, layer_pause_s=0.05, on_layer=kill_d1_once_it_has_data)
        out = p.finish({"r1", "r2"})
        assert out["r1"].state is TransferState.FAILED and out["r1"].error
        assert out["r2"].state is TransferState.DONE
        assert d2.wait("finished", request_id="r2")["digest"] == digests["r2"]
        assert p.blocks.num_free == NUM_BLOCKS
        assert p.tx.pair_state("d1") is PairState.BROKEN and p.tx.pair_state("d2") is PairState.READY

        digests = p.run_batch([("r3", "d2", 20, _expect(d2, "r3", 20))])  # P keeps serving D2
        assert p.finish({"r3"})["r3"].state is TransferState.DONE
        assert d2.wait("finished", request_id="r3")["digest"] == digests["r3"]

        d1_new = Peer("_decode_peer")  # D1 restarted: the pair is rebuilt under a new name
        p.connect("d1", d1_new, "p0-d1/g1")
        digests = p.run_batch([("r4", "d1", 20, _expect(d1_new, "r4", 20))])
        assert p.finish({"r4"})["r4"].state is TransferState.DONE
        assert d1_new.wait("finished", request_id="r4")["digest"] == digests["r4"]
    finally:
        for peer in (d1, d2, d1_new):
            if peer:
                peer.stop()
        p.close()


def test_stalled_prefill_fails_the_decode_side_within_the_timeout_and_the_pair_is_rebuilt():
    cache = PagedKVCache(_spec(), NUM_BLOCKS)
    blocks = BlockManager(NUM_BLOCKS, SPEC["block_size"])
    rx = KVReceiver(cache, _platform(), _cfg())
    p = Peer("_prefill_peer")
    try:
        for gen, stall in ((0, True), (1, False)):
            p.send(cmd="connect", pair_name=f"p0-d0/g{gen}")
            pair = rx.connect("p0", PairRendezvous.from_json(p.wait("rdzv")["rdzv"]))
            assert pair.wait_ready(30), pair.error
            p.wait("ready")
            rid = f"s{gen}"
            dst = tuple(blocks.grow(rid, 30))
            rx.expect(RecvRequest(rid, "p0", dst, 30))
            cmd = dict(cmd="send", request_id=rid, num_tokens=30, dst=list(dst), seed=5)
            if stall:
                cmd.update(stall_after=2, stall_s=TIMEOUT_S + 2.0)
            p.send(**cmd)
            st = _finish(rx, {rid}, timeout_s=TIMEOUT_S + 10)[rid]
            digest = blocks_digest(cache, dst) if st.state is TransferState.DONE else None
            blocks.free(rid)
            p_ev = p.wait("finished", request_id=rid)
            if stall:
                assert st.state is TransferState.FAILED and "Timed out" in st.error
                assert 0 < st.layers_done < SPEC["num_layers"]
                assert rx.pair_state("p0") is PairState.BROKEN
                assert p_ev["state"] == "failed" and p_ev["pair"] == "broken"
            else:
                assert st.state is TransferState.DONE and p_ev["state"] == "done"
                assert digest == p_ev["digest"]
            assert blocks.num_free == NUM_BLOCKS and p_ev["num_free"] == NUM_BLOCKS
    finally:
        p.stop()
        rx.close()


def test_the_host_hop_stages_every_message_through_host_buffers_bit_exact(monkeypatch):
    """The hop for a P and a D on one accelerator (transfer/kv/host_hop.py), forced on host tensors
    so the staging code runs: gloo whatever the platform (the fake HCCL's too), same bytes."""
    monkeypatch.setenv(CFG_ENV, json.dumps({"hop": "host"}))
    p, d = Prefill(), Peer("_decode_peer")
    try:
        p.connect("d0", d, "p0-d0/g0")
        pair = p.tx._channels["d0"].pair
        assert pair.staged and pair.transport.dist_backend == "gloo"
        for batch in ([("a", 37), ("b", 8)], [("c", 300)]):
            reqs = [(rid, "d0", n, _expect(d, rid, n)) for rid, n in batch]
            with torch.inference_mode():  # as in the engine's forward: the acknowledgement is an inference tensor
                digests = p.run_batch(reqs)
            ids = {rid for rid, _ in batch}
            assert all(st.state is TransferState.DONE for st in p.finish(ids).values())
            for rid in ids:
                ev = d.wait("finished", request_id=rid)
                assert ev["state"] == "done" and ev["digest"] == digests[rid]
    finally:
        d.stop()
        p.close()


def test_on_the_host_hop_a_dead_decode_fails_its_transfer_and_the_other_keeps_serving(monkeypatch):
    monkeypatch.setenv(CFG_ENV, json.dumps({"hop": "host"}))
    test_killing_one_decode_midway_fails_it_and_the_other_decode_keeps_serving()
