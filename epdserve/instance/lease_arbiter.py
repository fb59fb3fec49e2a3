"""`LeaseArbiter`: which stage computes next on one machine's CPU cores — the server side of the
`slo` co-location policy (`instance/colocation.py`; the client is `instance/core_lease.py`).

Every stage worker on the machine (E, P, D, in one process or several) takes the cores' lease
for each compute step — an encode batch, a prefill, a decode step — and gives it back after. One
holder at a time gets every core (work-conserving: the lease is never idle while someone waits);
the order follows the SLOs:

1. a decode step that is due (its TPOT pacing says so: `due <= now`), earliest due first;
2. prefill, first come first served (the nearer a request is to its first token, the sooner);
3. encode, first come first served;
4. a decode step not yet due (nobody else is waiting: it runs at once).

An encode holder is asked to yield (one `Y` byte) as soon as a prefill or a due decode step
waits; a prefill holder as soon as a due decode step waits; a decode holder never. The holder
gives the lease back at its next checkpoint (a vision block or LM layer boundary) and queues
again. A connection that closes — its process died — releases what it held.

Wire protocol (Unix stream socket, one connection per worker thread): the client sends 16-byte
frames `op kind pad[6] due` (`op` b"A" acquire / b"R" release, `kind` b"E" / b"P" / b"D", `due`
a float64 on CLOCK_MONOTONIC, which every process on the host shares); the server answers an
acquire with b"G" once granted and may send one b"Y" to the holder. The arbiter runs on its
own thread (a selector loop), in the launcher for a whole deployment or in an instance whose
co-located workers have no launcher's.
"""
from __future__ import annotations

import itertools
import logging
import os
import selectors
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger(__name__)

FRAME = struct.Struct("<cc6xd")
KINDS = (b"E", b"P", b"D")


@dataclass
class _Waiter:
    kind: bytes
    due: float
    seq: int


def choose(waiting: dict, now: float):
    """The connection to grant next among `waiting` ({conn: _Waiter}), by the order above."""
    if not waiting:
        return None
    items = list(waiting.items())
    due = [(w.due, w.seq, c) for c, w in items if w.kind == b"D" and w.due <= now]
    if due:
        return min(due, key=lambda t: t[:2])[2]
    for kind in (b"P", b"E"):
        same = [(w.seq, c) for c, w in items if w.kind == kind]
        if same:
            return min(same, key=lambda t: t[0])[1]
    return min(((w.due, w.seq, c) for c, w in items), key=lambda t: t[:2])[2]


def should_yield(holder_kind: bytes, waiting: dict, now: float) -> bool:
    """Is a waiter more urgent than the holder? (E yields to P or a due D; P to a due D.)"""
    if holder_kind == b"D":
        return False
    for w in waiting.values():
        if (w.kind == b"D" and w.due <= now) or (holder_kind == b"E" and w.kind == b"P"):
            return True
    return False


class LeaseArbiter:
    """Serves the lease at `path` (default: a fresh private directory) until `close()`."""

    def __init__(self, path: str | None = None):
        self._dir = None
        if path is None:
            self._dir = tempfile.mkdtemp(prefix="epdserve-cores-")
            path = os.path.join(self._dir, "lease.sock")
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        os.chmod(path, 0o600)  # this user's processes only
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._bufs: dict[socket.socket, bytes] = {}
        self._waiting: dict[socket.socket, _Waiter] = {}
        self._holder: socket.socket | None = None
        self._holder_kind = b""
        self._asked = False
        self._seq = itertools.count()
        self._closed = False
        self.grants: Counter = Counter()  # per kind (b"E"...), for benchmarks and tests
        self.held_s: Counter = Counter()  # seconds held, per kind
        self.yields_asked = 0
        self.started = time.monotonic()
        self._granted_at = 0.0
        self._thread = threading.Thread(target=self._run, name="lease-arbiter", daemon=True)

    def start(self) -> "LeaseArbiter":
        self._thread.start()
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(5.0)
        for s in [*self._bufs, self._listener, self._wake_r, self._wake_w]:
            s.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._sel.select(self._timeout()):
                s = key.fileobj
                if s is self._listener:
                    self._accept()
                elif s is self._wake_r:
                    return
                else:
                    self._read(s)
            self._schedule()

    def _timeout(self) -> float | None:
        """Until the next waiting decode step falls due (then a holder may have to yield)."""
        if self._holder is None or self._asked:
            return None
        now = time.monotonic()
        later = [w.due - now for w in self._waiting.values() if w.kind == b"D" and w.due > now]
        return max(0.0, min(later)) if later else None

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self._bufs[conn] = b""
        self._sel.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        buf = self._bufs[conn] + data
        while len(buf) >= FRAME.size:
            op, kind, due = FRAME.unpack_from(buf)
            buf = buf[FRAME.size:]
            if op == b"A" and kind in KINDS and conn is not self._holder and conn not in self._waiting:
                self._waiting[conn] = _Waiter(kind, due, next(self._seq))
            elif op == b"R" and conn is self._holder:
                self._end_hold()
            else:
                log.warning("lease arbiter: dropping a client that sent %r %r out of turn", op, kind)
                self._drop(conn)
                return
        self._bufs[conn] = buf

    def _drop(self, conn: socket.socket) -> None:
        self._waiting.pop(conn, None)
        self._bufs.pop(conn, None)
        if conn is self._holder:
            self._end_hold()
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _end_hold(self) -> None:
        self.held_s[self._holder_kind] += time.monotonic() - self._granted_at
        self._holder = None

    def summary(self) -> str:
        """One line: seconds held and grants per stage, and the share of the time the cores were held."""
        wall = max(1e-9, time.monotonic() - self.started)
        parts = [f"{k.decode()} {self.held_s[k]:.1f} s/{self.grants[k]}" for k in KINDS]
        return (f"core lease over {wall:.1f} s: held {sum(self.held_s.values()) / wall:.0%} "
                f"({', '.join(parts)} grants), {self.yields_asked} yields asked")

    def _schedule(self) -> None:
        now = time.monotonic()
        while self._holder is None and self._waiting:
            conn = choose(self._waiting, now)
            w = self._waiting.pop(conn)
            self._holder, self._holder_kind, self._asked = conn, w.kind, False
            self.grants[w.kind] += 1
            self._granted_at = now
            self._send(conn, b"G")  # a failed send drops the connection, and with it the hold
        if self._holder is not None and not self._asked and should_yield(self._holder_kind, self._waiting, now):
            self._asked = True
            self.yields_asked += 1
            self._send(self._holder, b"Y")
            if self._holder is None:  # that send failed: grant the next
                self._schedule()

    def _send(self, conn: socket.socket, byte: bytes) -> bool:
        try:
            conn.send(byte)
            return True
        except OSError:
            self._drop(conn)
            return False
