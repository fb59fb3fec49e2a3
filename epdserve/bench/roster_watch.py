"""`RosterWatch`: the role changes of a live epdserve deployment during a benchmark run.

Polls the scheduler's `GetServerInfo` once a second on its own thread and records an event
whenever the roster's roles change — an instance switching roles (`--mode auto`'s controller)
shows as its old id leaving and a new id with the new roles joining — as
{"t_s": seconds from the run's start, "label": "EP -> ED"}, for `bench serve`'s timeline plot.
"""
from __future__ import annotations

import threading
import time
from collections import Counter

import grpc

from epdserve.rpc import serve_pb2, serve_pb2_grpc


class RosterWatch:
    def __init__(self, address: str, interval_s: float = 1.0):
        self.address = address
        self.interval_s = interval_s
        self.events: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="roster-watch", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> "RosterWatch":
        self._t0 = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _roles(self, stub) -> Counter | None:
        try:
            info = stub.GetServerInfo(serve_pb2.GetServerInfoRequest(), timeout=2.0)
        except grpc.RpcError:
            return None
        return Counter(i.roles for i in info.instances if not i.draining)

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = serve_pb2_grpc.EPDServeStub(ch)
            last = self._roles(stub)
            while not self._stop.wait(self.interval_s):
                now = self._roles(stub)
                if now is None or last is None or now == last:
                    last = now if now is not None else last
                    continue
                gone, came = last - now, now - last
                label = f"{'+'.join(sorted(gone.elements())) or '-'} -> {'+'.join(sorted(came.elements())) or '-'}"
                self.events.append({"t_s": round(time.time() - self._t0, 2), "label": label})
                last = now
