"""`SteadyLoad`: a few clients sending requests without pause until told to stop, every result
kept, so a test can change a running deployment (kill a pod, add one) and then check that every
request came back and what it came back with."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from epdserve.client import Client


@dataclass(frozen=True)
class Job:
    prompt: str
    images: tuple[bytes, ...]
    max_tokens: int


@dataclass
class SteadyLoad:
    target: str  # a client target: "host:port", a resolver URI ("ipv4:a:p,b:p"), ...
    api_key: str
    jobs: list[Job]
    threads: int = 3
    results: list[tuple[int, list[int]]] = field(default_factory=list)  # (job index, token ids)
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    streaming: threading.Event = field(default_factory=threading.Event)  # set at the first token of any request

    def __post_init__(self):
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = itertools.count()
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(self.threads)]

    def __enter__(self) -> SteadyLoad:
        for t in self._workers:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 300) -> None:
        """No new request; wait for those in flight."""
        self._stop.set()
        for t in self._workers:
            t.join(timeout_s)
            assert not t.is_alive(), "a request did not come back"

    @property
    def done(self) -> int:
        with self._lock:
            return len(self.results)

    def _run(self) -> None:
        with Client(self.target, api_key=self.api_key, timeout=300) as client:
            while not self._stop.is_set():
                with self._lock:
                    i = next(self._next)
                job = self.jobs[i % len(self.jobs)]
                try:
                    ids: list[int] = []
                    for d in client.generate_stream(job.prompt, images=list(job.images), max_tokens=job.max_tokens,
                                                    temperature=0.0, ignore_eos=True):
                        ids += d.token_ids
                        self.streaming.set()
                    with self._lock:
                        self.results.append((i % len(self.jobs), ids))
                except Exception as e:  # noqa: BLE001 - every failure is a lost request, reported by the test
                    with self._lock:
                        self.errors.append((i, e))
