"""P side: hooks a `KVSender` into the engine's layer loop (layerwise P→D sending).

`LayerwiseSendHook` is appended to `engine.runner.layer_hooks`. After layer 0 of a forward it
opens a batch with every request whose prompt completes in this forward and that has a decode
reservation (`expect`ed), then after each layer posts that layer's KV, so layer L travels
while layer L+1 computes. The whole prompt's blocks are sent in the last prefill chunk (earlier
chunks' KV is already in them). The owner polls `sender.pop_finished()` and frees a request's
blocks only when its transfer finished (gloo may read them until then).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from epdserve.transfer.kv import KVSender, SendRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Destination:
    peer: str  # decode instance id
    dst_block_ids: tuple[int, ...]


class LayerwiseSendHook:
    def __init__(self, engine, sender: KVSender):
        self.engine = engine
        self.sender = sender
        self.expected: dict[str, Destination] = {}
        self.started: set[str] = set()  # transfers begun, not yet reported finished
        self.refused: dict[str, str] = {}  # request id -> why its transfer could not begin
        self._open = False
        engine.runner.layer_hooks.append(self)

    def expect(self, request_id: str, dest: Destination) -> None:
        self.expected[request_id] = dest

    def forget(self, request_id: str) -> None:
        """The request ended before its prefill completed: nothing will be sent."""
        self.expected.pop(request_id, None)

    def __call__(self, layer: int, batch) -> None:
        if layer == 0:
            self._begin(batch)
        if self._open:
            self.sender.save_layer(layer)
            if layer == self.engine.adapter.num_layers - 1:
                self._open = False

    def _begin(self, batch) -> None:
        blocks = self.engine.blocks
        reqs = []
        for item in batch:
            seq = item.seq
            rid = seq.request_id
            if item.end != seq.prompt_len or rid not in self.expected:
                continue
            dest = self.expected.pop(rid)
            n = blocks.blocks_needed(seq.prompt_len)
            src = tuple(blocks.table(rid)[:n])
            reqs.append(SendRequest(rid, dest.peer, src, dest.dst_block_ids, seq.prompt_len))
        if not reqs:
            return
        try:
            self.sender.begin_batch(reqs)
        except (ValueError, RuntimeError) as e:  # a bad reservation: those requests fail, the forward goes on
            log.warning("KV transfer of %d request(s) refused: %s", len(reqs), e)
            self.refused.update((r.request_id, str(e)) for r in reqs)
            return
        self.started.update(r.request_id for r in reqs)
        self._open = True

    def abort_open_batch(self, reason: str) -> None:
        """The forward raised midway: its transfers fail (the pairs break)."""
        if self._open:
            self._open = False
            self.sender.abort_batch(reason)
