"""`PairConnection`: one side of a P–D pair's two-rank process group, and the pair's header store.

The group is built in a background thread (both sides must arrive within
`connect_timeout_s`) straight from the platform (ProcessGroupGloo / NCCL / HCCL over a
PrefixStore on the prefill side's TCP store; no global world). State: CONNECTING → READY →
BROKEN (peer died, stalled or never came) or CLOSED (by us). A broken pair is never reused:
the control plane rebuilds it under a new pair name.

How failures surface (measured with gloo on torch 2.13):
- a dead peer: the next post, or the wait of a pending one, raises "Connection closed by peer"
  within milliseconds;
- a stalled peer: `work.wait(timeout)` raises after `timeout`, and gloo then closes the whole
  pair ("Application timeout caused pair closure"): every other pending op fails at once and
  the peer's next op fails too. So a timed-out wait is final for the pair;
- `Work.is_completed()` stays False for gloo send/recv until `wait()` is called, so progress is
  observed by blocking waits in a per-pair thread, never by polling works;
- `ProcessGroupGloo.abort()` does not interrupt pending waits. `interrupt()` therefore asks the
  platform (`Platform.interrupt_pair_group`): on gloo it times out a private recv, which closes
  the pair the same way and wakes every blocked wait; on NCCL/HCCL it calls `abort()`.
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore

from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.layout import as_bytes
from epdserve.transfer.kv.messages import BatchHeader, PairRendezvous
from epdserve.transfer.kv.state import PairState

KV_TAG = 0  # every KV message; order alone pairs sends with receives (HCCL ignores tags)


class PairBroken(RuntimeError):
    """The pair cannot carry messages any more; its in-flight transfers have failed."""


class PairConnection:
    def __init__(self, rdzv: PairRendezvous, platform, config: KVTransferConfig, device: torch.device | str = "cpu"):
        self.rdzv = rdzv
        self.platform = platform
        self.config = config
        self.device = torch.device(device)
        self.peer_rank = 1 - rdzv.rank
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._state = PairState.CONNECTING
        self._error: str | None = None
        self._pg = None
        self._store = None
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

    def enter_thread(self) -> None:
        """Every thread of this pair selects the pair's device first (device selection is per thread)."""
        self.platform.set_thread_device(self.device.index or 0)

    def _connect(self) -> None:
        r, cfg = self.rdzv, self.config
        try:
            self.enter_thread()  # the HCCL communicator is created in the calling thread, on its device
            client = TCPStore(r.host, r.port, None, False, timeout=timedelta(seconds=cfg.connect_timeout_s))
            store = PrefixStore(f"epdserve-kv/{r.pair_name}", client)
            # The group's own timeout outlives ours, so our waits fire first (NCCL's watchdog
            # would otherwise tear the process down on its own timeout).
            pg_timeout = timedelta(seconds=cfg.connect_timeout_s + cfg.timeout_s)
            pg = self.platform.make_pair_group(store, r.rank, 2, pg_timeout, group_name=f"epdserve-kv/{r.pair_name}")
        except Exception as e:  # any failure to build is this pair's failure, reported in its state
            self._set_broken(f"pair {r.pair_name!r}: could not build the process group "
                             f"({self.platform.dist_backend} via {r.host}:{r.port}): {e}")
            self._ready.set()
            return
        with self._lock:
            if self._state is PairState.CONNECTING:
                self._pg, self._store, self._state = pg, store, PairState.READY
        self._ready.set()

    # ------------------------------------------------------------------ KV messages
    def isend(self, t: torch.Tensor):
        return self._post("send", t)

    def irecv(self, t: torch.Tensor):
        return self._post("recv", t)

    def _post(self, op: str, t: torch.Tensor):
        pg = self._pg
        if self._state is not PairState.READY or pg is None:
            raise PairBroken(f"pair {self.rdzv.pair_name!r} is {self._state.value}: {self._error or 'not connected'}")
        try:
            return getattr(pg, op)([as_bytes(t)], self.peer_rank, KV_TAG)
        except Exception as e:
            self.mark_broken(f"{op} failed: {e}")
            raise PairBroken(self._error) from None

    def wait(self, work, what: str) -> None:
        """Wait for one posted message for at most `timeout_s`; PairBroken when it does not complete."""
        try:
            work.wait(timedelta(seconds=self.config.timeout_s))
        except Exception as e:
            self.mark_broken(f"{what}: {e}")
            raise PairBroken(self._error) from None

    # ------------------------------------------------------------------ batch headers
    def publish_header(self, header: BatchHeader) -> None:
        try:
            self._store.set(f"batch-header/{header.seq}", header.to_json())
        except Exception as e:
            self.mark_broken(f"publishing batch header {header.seq}: {e}")
            raise PairBroken(self._error) from None

    def poll_header(self, seq: int) -> BatchHeader | None:
        """Batch header `seq` if the sender published it (removed from the store), else None.
        Raises ValueError for a malformed header, PairBroken when the store is unreachable."""
        key = f"batch-header/{seq}"
        try:
            if not self._store.check([key]):
                return None
            text = self._store.get(key)
            self._store.delete_key(key)
        except Exception as e:
            self.mark_broken(f"reading batch header {seq}: {e}")
            raise PairBroken(self._error) from None
        return BatchHeader.from_json(text)

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
            return True

    def interrupt(self) -> None:
        pg = self._pg
        if pg is None:
            return
        self.platform.interrupt_pair_group(pg, self.peer_rank)

    def close(self) -> None:
        with self._lock:
            was = self._state
            self._state = PairState.CLOSED
            self._error = self._error or "closed"
        if was in (PairState.READY, PairState.BROKEN):
            self.interrupt()
        self._ready.set()
        self._pg = None
        self._store = None
