"""The `slo` co-location policy on CPU, worker side: a lease on the machine's cores per compute
step, decode paced by its TPOT SLO, and checkpoints where encode and prefill give way.

- `CoreLease`: one worker thread's connection to the `LeaseArbiter` (`instance/lease_arbiter.py`):
  `acquire(kind, due)` blocks until granted, `release()`, `yield_requested()` (non-blocking).
  If the arbiter is gone, the lease logs once and stops arbitrating: the worker computes
  unarbitrated rather than stop serving.
- `LeaseGate`: the engine's compute gate (`engine/compute_gate.py`) over a `CoreLease`. A decode
  step asks for the lease with a due time: `pace_s` (a share of the TPOT SLO) after its
  previous step ended, less the step's own running time; before that it only runs if nobody
  else waits. So while encode or prefill work waits, decode takes what keeps TPOT under its
  SLO and leaves the rest to them; with nothing else waiting it runs flat out.
- `Checkpoints`: the model's vision blocks and LM layers call `poll()` (forward pre-hooks,
  installed once per loaded model); on the thread of an E or P holder asked to yield, it hands
  the lease over and queues again, so a due decode step waits at most half a layer; a paced decode
  step asks that much ahead of its due time (learnt from the waits it saw), so it starts on time.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager

from epdserve.instance.lease_arbiter import FRAME

log = logging.getLogger(__name__)

PACE_SHARE = 0.7  # decode steps are paced at this share of the TPOT SLO (the rest: waiting for a checkpoint, jitter)
_EMA = 0.2


class CoreLease:
    def __init__(self, path: str, name: str = "worker"):
        self.name = name
        self.broken = False
        self.held = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)

    def acquire(self, kind: str, due: float = 0.0) -> None:
        if self.broken:
            return
        try:
            self._sock.sendall(FRAME.pack(b"A", kind.encode(), due))
            while True:  # a "Y" meant for the previous hold may come first
                b = self._sock.recv(1)
                if b == b"G":
                    break
                if not b:
                    raise ConnectionError("the lease arbiter closed the connection")
        except OSError as e:
            self._break(e)
            return
        self.held = True

    def release(self) -> None:
        if self.broken or not self.held:
            return
        self.held = False
        try:
            self._sock.sendall(FRAME.pack(b"R", b"E", 0.0))
        except OSError as e:
            self._break(e)

    def yield_requested(self) -> bool:
        """Has the arbiter asked this holder to give way? (Never blocks.)"""
        if self.broken or not self.held:
            return False
        try:
            data = self._sock.recv(16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as e:
            self._break(e)
            return False
        if not data:
            self._break(ConnectionError("the lease arbiter closed the connection"))
            return False
        return b"Y" in data

    def close(self) -> None:
        self.broken = True
        self._sock.close()

    def _break(self, e: BaseException) -> None:
        if not self.broken:
            log.warning("%s: core lease lost (%s); computing unarbitrated from now on", self.name, e)
        self.broken = True
        self.held = False


class Checkpoints:
    """Which thread holds which gate, for the layer hooks (one per instance process)."""

    def __init__(self):
        self._by_thread: dict[int, LeaseGate] = {}

    def enter(self, gate: "LeaseGate") -> None:
        self._by_thread[threading.get_ident()] = gate

    def leave(self) -> None:
        self._by_thread.pop(threading.get_ident(), None)

    def poll(self, *_args) -> None:
        gate = self._by_thread.get(threading.get_ident())
        if gate is not None:
            gate.checkpoint()

    def install(self, adapter) -> list:
        """Forward pre-hooks on the vision tower's blocks and the LM's decoder layers, and on the MLP
        inside each (two checkpoints per layer: attention | MLP); returns the handles."""
        layers = list(getattr(adapter.vision_tower, "blocks", [])) + list(adapter.layers)
        modules = [m for layer in layers for m in (layer, getattr(layer, "mlp", None)) if m is not None]
        return [m.register_forward_pre_hook(self.poll) for m in modules]


class LeaseGate:
    """The engine's compute gate for one worker thread (see the module docstring)."""

    def __init__(self, lease: CoreLease, checkpoints: Checkpoints, tpot_slo_s: float):
        self.lease = lease
        self.checkpoints = checkpoints
        self.pace_s = PACE_SHARE * tpot_slo_s
        self._kind = ""
        self._last_decode_end: float | None = None
        self._decode_s = 0.0  # running mean of a decode step's time under the lease
        self.yields = 0
        self._lead_s = 0.0  # asks this much before a decode step's due time: the holder's usual way to a checkpoint
        self.last_late_s = 0.0  # the last hold: how long it waited for the cores beyond its due time
        self.last_hold_s = 0.0  # ... and how long it held them

    def decode_due(self) -> float:
        """When the next decode step must run to keep TPOT at the pace (0: now)."""
        if self._last_decode_end is None:
            return 0.0
        return self._last_decode_end + max(0.0, self.pace_s - self._decode_s)

    @contextmanager
    def hold(self, kind: str):
        due = self.decode_due() if kind == "D" else 0.0
        asked = time.monotonic()
        sent = due - self._lead_s if due else 0.0
        self.lease.acquire(kind, sent)
        self._kind = kind
        self.checkpoints.enter(self)
        t0 = time.monotonic()
        self.last_late_s = max(0.0, t0 - max(asked, due))
        if kind == "D" and sent > asked:  # a paced step: learn how long the holder took to give way
            self._lead_s += _EMA * (max(0.0, t0 - sent) - self._lead_s)
        try:
            yield
        finally:
            self.checkpoints.leave()
            self.lease.release()
            end = time.monotonic()
            self.last_hold_s = end - t0
            if kind == "D":
                self._decode_s += _EMA * (self.last_hold_s - self._decode_s) if self._decode_s else self.last_hold_s
                self._last_decode_end = end

    def checkpoint(self) -> None:
        if self._kind != "D" and self.lease.yield_requested():
            self.yields += 1
            self.lease.release()
            self.lease.acquire(self._kind)

    def close(self) -> None:
        self.lease.close()


def open_gate(path: str, name: str, checkpoints: Checkpoints, tpot_slo_s: float) -> LeaseGate | None:
    """A worker thread's gate on the arbiter at `path`; None (logged) if the arbiter cannot be
    reached: the worker then computes unarbitrated rather than not at all."""
    try:
        lease = CoreLease(path, name)
    except OSError as e:
        log.warning("%s: cannot reach the core-lease arbiter at %s (%s); computing unarbitrated", name, path, e)
        return None
    return LeaseGate(lease, checkpoints, tpot_slo_s)
