"""`PairConnection`: one rank's side of a P–D pair's process group (every rank of both instances),
and the pair's header store.

The group is built in a background thread (both sides must arrive within
`connect_timeout_s`) straight from the platform (ProcessGroupGloo / NCCL / HCCL over the pair's
namespace of the prefill side's pair store — in process on P, through the prefill instance's
authenticated `KvStore` RPC on D: `PairNetwork`; no global world, no listening store). On the
`host` hop (`KVTransferConfig.hop`, for a P and a D on one accelerator) the group is gloo whatever
the device and every message is staged through a host buffer (`host_hop.py`). Its data
sockets bind the network's host. State: CONNECTING → READY →
BROKEN (peer died, stalled or never came) or CLOSED (by us). A broken pair is never reused:
the control plane rebuilds it under a new pair name.

Waiting: every wait goes through `Platform.wait_work` with our own deadline (`timeout_s`). On
NCCL / HCCL it polls `Work.is_completed()` (their `wait()` never blocks the host: it only chains
the calling thread's stream onto the work), so no stream of ours is ever made to wait on the
peer; on gloo, whose works progress only inside `wait()`, it is a blocking wait.

Threads: each thread of a pair selects the pair's device and runs on the pair's own side stream
(`enter_thread`; one per pair, from `Platform.new_stream`, given back by `close`), so a copy made
by a pair thread (P reading D's acknowledgement) never queues behind the engine's compute. On NPU
that stream is never HCCL's nor another pair's or worker's (`platform/npu_streams.py`), which the
pair checks once its communicator exists (`Platform.pair_stream_conflict`). The backend's communicator is created, with its blocking
rendezvous, by the first message of the pair; `_connect` sends that message itself (a 1-byte
handshake), so the rendezvous never happens inside P's forward.

How failures surface (measured with gloo on torch 2.13):
- a dead peer: the next post, or the wait of a pending one, raises "Connection closed by peer"
  within milliseconds;
- a stalled peer: the wait times out after `timeout_s`; the pair is then broken on purpose
  (`interrupt`), which fails every other pending op and the peer's next op too. So a timed-out
  wait is final for the pair;
- interrupting: `Platform.interrupt_pair_group`: on gloo (whose abort() does not wake pending
  waits) it times out a private recv, which closes the pair; on HCCL `abort_hccl_comm` (torch_npu's
  `pg.abort()` is torch's no-op Backend::abort; its destroy may return HCCL_E_AGAIN and leave a
  running operation on HCCL's own stream until HCCL_EXEC_TIMEOUT: see `NpuPlatform`); on NCCL
  `abort()`. The backends' watchdogs are
  told not to take the process down (`Platform.prepare_pair_groups`), and the group's own
  timeout outlives ours, so one bad pair fails its transfers, never the instance.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.host_hop import StagedWork, stage_recv, stage_send, transport_platform
from epdserve.transfer.kv.layout import as_bytes
from epdserve.transfer.kv.messages import BatchHeader, PairRendezvous
from epdserve.transfer.kv.network import PairNetwork
from epdserve.transfer.kv.state import PairState

KV_TAG = 0  # every KV message; order alone pairs sends with receives (HCCL ignores tags)


class PairBroken(RuntimeError):
    """The pair cannot carry messages any more; its in-flight transfers have failed."""


class PairConnection:
    def __init__(self, rdzv: PairRendezvous, platform, config: KVTransferConfig, device: torch.device | str = "cpu",
                 on_leak=None, peers: list[int] | None = None):
        """`peers`: the group ranks this process exchanges messages with (links.py `group_peers`;
        default the other side's rank 0)."""
        self.rdzv = rdzv
        self.platform = platform  # the device's: thread device, side streams
        self.transport = transport_platform(platform, config.hop)  # the group's backend: build, wait, break
        self.staged = config.hop == "host"  # messages staged through host buffers (on CPU too: same bytes)
        self.config = config
        self.device = torch.device(device)
        self.peers = sorted(peers) if peers is not None else [rdzv.for_peer().rank]
        # the default destination and source of a message (a rank with no link still joins the group)
        self.peer_rank = self.peers[0] if self.peers else rdzv.for_peer().rank
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._state = PairState.CONNECTING
        self._error: str | None = None
        self._drain_deadline = 0.0  # set when the pair breaks or closes: the end of the drain budget
        self._pg = None
        self._store = None
        self._held = ()  # (group, store) of a pair that ended: dropped together, with this object
        self._stream = None  # the pair's side stream, shared by its threads (None on CPU)
        self._stream_taken = False
        self._on_leak = on_leak  # called once if the teardown left an operation running (`drain`)
        self.leaked = False
        self._thread = threading.Thread(target=self._connect, name=f"kv-connect:{rdzv.pair_name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> PairState:
        return self._state

    @property
    def error(self) -> str | None:
        return self._error

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the group is built (True) or failed / timed out (False)."""
        self._ready.wait(timeout_s)
        return self._state is PairState.READY

    def enter_thread(self) -> bool:
        """Every thread of this pair selects the pair's device first (device selection is per
        thread) and a side stream of its own (None on CPU: nothing to select). False, with the
        pair broken, when the device cannot be selected."""
        try:
            self._select_device()
        except Exception as e:
            self.mark_broken(f"pair {self.rdzv.pair_name!r}: cannot select {self.device} in this thread: {e}")
            return False
        return True

    def _select_device(self) -> None:
        self.platform.set_thread_device(self.device.index or 0)
        with self._lock:
            if not self._stream_taken:
                self._stream, self._stream_taken = self.platform.new_stream(), True
            stream = self._stream
        if stream is not None:
            self.platform.set_thread_stream(stream)

    def _connect(self) -> None:
        r, cfg = self.rdzv, self.config
        net = cfg.network or PairNetwork()
        pg = store = None
        try:
            self._select_device()  # the communicator is built in this thread, on this device
            store = net.open_store(r, timedelta(seconds=cfg.connect_timeout_s))
            # The group's own timeout outlives ours, so our waits fire first.
            pg_timeout = timedelta(seconds=cfg.connect_timeout_s + cfg.timeout_s)
            pg = self.transport.make_pair_group(store, r.rank, r.world, pg_timeout,
                                                group_name=f"epdserve-kv/{r.pair_name}", host=net.host)
            self._handshake(pg)
            conflict = self.transport.pair_stream_conflict(pg, self.peer_rank)
            if conflict:
                raise RuntimeError(conflict)
        except Exception as e:  # any failure to build is this pair's failure, reported in its state
            if pg is not None:
                self._interrupt(pg)
            self._set_broken(f"pair {r.pair_name!r}: could not build the process group "
                             f"({self.transport.dist_backend}, {self.config.hop} hop, via {r.host}:{r.port}): {e}")
            self._ready.set()
            self._end_store(store, pg)
            return
        self._held = (pg, store)
        with self._lock:
            ready = self._state is PairState.CONNECTING
            if ready:
                self._pg, self._store, self._state = pg, store, PairState.READY
        self._ready.set()
        if not ready:  # closed while connecting
            self._interrupt(pg)
            self._end_store(store, pg)

    def _end_store(self, store, pg) -> None:
        """The pair is over: its store namespace goes. A group keeps only the C++ half of its
        store, so both stay referenced here for as long as this connection lives."""
        if store is None:
            return
        self._held = (pg, store)
        store.end(release=self.rdzv.leader)  # an instance's rank 0 drops the namespace, its other ranks leave it

    def _handshake(self, pg) -> None:
        """One byte with each peer in this thread (the lower group rank sends): the backend builds
        its communicators (blocking rendezvous) here rather than in the first KV message's thread.
        Every rank posts its peers in ascending order, so the pairs' rendezvous come in one global
        order (no cycle of ranks each waiting for another's)."""
        works = []
        for peer in self.peers:
            probe = torch.ones(1, dtype=torch.uint8, device="cpu" if self.staged else self.device)
            op = pg.send if self.rdzv.rank < peer else pg.recv
            works.append(op([probe], peer, KV_TAG))
        for work in works:
            self.transport.wait_work(work, self.config.connect_timeout_s)

    # ------------------------------------------------------------------ KV messages
    def isend(self, t: torch.Tensor, dst: int | None = None):
        return self._post("send", t, self.peer_rank if dst is None else dst)

    def irecv(self, t: torch.Tensor, src: int | None = None):
        return self._post("recv", t, self.peer_rank if src is None else src)

    def _post(self, op: str, t: torch.Tensor, peer: int):
        pg = self._pg
        if self._state is not PairState.READY or pg is None:
            raise PairBroken(f"pair {self.rdzv.pair_name!r} is {self._state.value}: {self._error or 'not connected'}")
        try:
            data = as_bytes(t)
            if not self.staged:
                return getattr(pg, op)([data], peer, KV_TAG)
            if op == "send":
                host = stage_send(data)
                return StagedWork(pg.send([host], peer, KV_TAG), host)
            host = stage_recv(data)
            return StagedWork(pg.recv([host], peer, KV_TAG), host, data)
        except Exception as e:
            self.mark_broken(f"{op} failed: {e}")
            raise PairBroken(self._error) from None

    def wait(self, work, what: str) -> None:
        """Wait for one posted message for at most `timeout_s`; PairBroken when it does not
        complete. On a pair already broken, every remaining wait shares one `timeout_s` budget
        (a message pending when an HCCL communicator is destroyed may never complete)."""
        if self._state is not PairState.READY:
            self.drain([work])
            raise PairBroken(self._error or "pair closed")
        try:
            self.transport.wait_work(work, self.config.timeout_s)
        except Exception as e:
            self.mark_broken(f"{what}: {e}")
            raise PairBroken(self._error) from None

    def drain(self, works) -> list:
        """After the pair broke: wait, within one `timeout_s` from the break in all, for posted
        messages to end (failed or done), so nothing writes into their buffers any more. Returns
        the works that had not ended by then (their buffers may still be written).

        Such a work means the interrupt could not end the backend's communicator: on HCCL,
        HcclCommDestroy returned HCCL_E_AGAIN ("comm is in use"; it destroys nothing, while an idle
        communicator's destroy fails its operations at once), which torch_npu ignores before
        dropping its handle (HCCLUtils.cpp destroyHcclComm; tests/fakes/hccl_destroy.py): nothing
        can destroy that communicator any more. Where the platform bounds such works
        (`stuck_work_bound_s` not None: HCCL), the pair counts as one leaked communicator, once
        (`on_leak`; the connectors' `counters.leaked_communicators`)."""
        works, left_over = list(works), []
        for work in works:
            left = self._drain_deadline - time.monotonic()
            if left > 0:
                try:
                    self.transport.wait_work(work, left)
                except Exception:  # the expected outcome on a broken pair
                    pass
            if not work_ended(work):
                left_over.append(work)
        if left_over and self.transport.stuck_work_bound_s() is not None:
            with self._lock:
                first, self.leaked = not self.leaked, True
            if first and self._on_leak is not None:
                self._on_leak()
        return left_over

    # ------------------------------------------------------------------ batch headers
    def publish_header(self, header: BatchHeader) -> None:
        """P's rank 0: the batch's header, once for each D rank (each takes its own)."""
        try:
            text = header.to_json()
            for s in range(self.rdzv.d_degree):
                self._live_store().set(f"batch-header/{header.seq}/{s}", text)
        except Exception as e:
            self.mark_broken(f"publishing batch header {header.seq}: {e}")
            raise PairBroken(self._error) from None

    def poll_header(self, seq: int, wait_s: float = 0.0) -> BatchHeader | None:
        """Batch header `seq` once the sender published it (removed from the store), waiting up to
        `wait_s` for it; else None. Raises ValueError for a malformed header, PairBroken when the
        store is unreachable."""
        try:
            text = self._live_store().take(f"batch-header/{seq}/{self.rdzv.local_rank}", wait_s)
        except Exception as e:
            self.mark_broken(f"reading batch header {seq}: {e}")
            raise PairBroken(self._error) from None
        return None if text is None else BatchHeader.from_json(text)

    def _live_store(self):
        store = self._store
        if store is None:
            raise PairBroken(f"pair {self.rdzv.pair_name!r} is {self._state.value}")
        return store

    # ------------------------------------------------------------------ teardown
    def mark_broken(self, reason: str) -> None:
        """Declare the pair dead and wake every blocked wait on it (first reason wins)."""
        if self._set_broken(reason):
            self.interrupt()

    def _set_broken(self, reason: str) -> bool:
        with self._lock:
            if self._state in (PairState.BROKEN, PairState.CLOSED):
                return False
            self._state, self._error = PairState.BROKEN, reason
            self._drain_deadline = time.monotonic() + self.config.timeout_s
            return True

    def interrupt(self) -> None:
        pg = self._pg
        if pg is None:
            return
        self._interrupt(pg)

    def _interrupt(self, pg) -> None:
        """Break the group towards every peer where the backend breaks it per peer (gloo: one
        connection each), else once (NCCL / HCCL abort the whole communicator)."""
        for peer in self.peers if self.transport.interrupts_per_peer else self.peers[:1]:
            self.transport.interrupt_pair_group(pg, peer)

    def close(self) -> None:
        with self._lock:
            was = self._state
            if was is not PairState.BROKEN:
                self._drain_deadline = time.monotonic() + self.config.timeout_s
            self._state = PairState.CLOSED
            self._error = self._error or "closed"
        if was in (PairState.READY, PairState.BROKEN):
            self.interrupt()
        self._ready.set()
        pg, store = self._pg, self._store
        self._pg = None
        self._store = None
        self._end_store(store, pg)
        with self._lock:
            stream, self._stream = self._stream, None
        self.platform.release_stream(stream)


def work_ended(work) -> bool:
    """Has a posted message ended (done or failed)? torch's Work.is_completed (ProcessGroupHCCL
    WorkHCCL::isCompleted: an exception, or the end event fired)."""
    try:
        return bool(work.is_completed())
    except Exception:  # a failed work may raise here: it has ended
        return True
