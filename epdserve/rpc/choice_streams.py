"""`choice_streams`: one generation stream of n choices (OpenAI's `n`, sampling.n) as n streams.

The scheduler serves a request with n choices as one sequence group (the prompt prefilled once,
one KV transfer in P-D; engine/sequence_group.py) and streams every choice's messages on one
stream, each with its `index`; each choice's last message is finished and carries its usage.
Both fronts (the HTTP front, `Client.generate_choices`) read it as n streams, choice j's messages
in order on stream j: they pull the one stream under a lock, each message to its choice's queue
(no background task: a message waits only until its choice's reader asks). A failure of the one
stream is every choice's; closing any of them closes it (the request is aborted if unfinished).
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator


class _Shared:
    def __init__(self, source: AsyncIterator, n: int):
        self.source, self.n = source, n
        self.queues = [collections.deque() for _ in range(n)]
        self.lock = asyncio.Lock()
        self.error: BaseException | None = None
        self.ended = False
        self.closed = False

    async def next_of(self, j: int):
        while True:
            if self.queues[j]:
                return self.queues[j].popleft()
            if self.error is not None:
                raise self.error
            if self.ended:
                raise StopAsyncIteration
            async with self.lock:
                if self.queues[j] or self.error is not None or self.ended:
                    continue
                try:
                    m = await self.source.__anext__()
                except StopAsyncIteration:
                    self.ended = True
                    continue
                except Exception as e:
                    self.error = e
                    continue
                if not 0 <= m.index < self.n:
                    self.error = RuntimeError(f"a message for choice {m.index} of {self.n}")
                    continue
                self.queues[m.index].append(m)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self.source.aclose()


class ChoiceStream:
    """Choice j's messages of a shared stream (an async iterator; `aclose` closes the shared one)."""

    def __init__(self, shared: _Shared, j: int):
        self._shared, self.index = shared, j
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        m = await self._shared.next_of(self.index)
        self._done = bool(m.finished)
        return m

    async def aclose(self) -> None:
        await self._shared.aclose()


def choice_streams(source: AsyncIterator, n: int) -> list:
    """`source`'s messages as n streams by their `index` (n == 1: [source] itself)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return [source]
    shared = _Shared(source, n)
    return [ChoiceStream(shared, j) for j in range(n)]
