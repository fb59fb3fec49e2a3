"""`KVSender`: the prefill side — sends each batch's KV layer by layer to its decode peers.

Engine protocol (one forward at a time):
    begin_batch([SendRequest, ...])   before the forward: one header per peer is published
    save_layer(i)                     after layer i's KV is written: its messages are posted
                                      (isend, so they travel while layer i+1 computes); after
                                      the last layer, D's acknowledgement is awaited
    pop_finished()                    each loop iteration: DONE (D acknowledged) / FAILED
    abort_batch(reason)               if the forward fails midway
The engine frees a request's blocks only once its transfer is finished: until then gloo/HCCL
may still read them. A per-peer waiter thread waits on the posted messages in post order.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.endpoint import PairEndpoint
from epdserve.transfer.kv.layout import Chunk, layer_plan, select_blocks
from epdserve.transfer.kv.messages import BatchHeader, RequestEntry
from epdserve.transfer.kv.pair import PairBroken, PairConnection
from epdserve.transfer.kv.state import PairState, TransferState, TransferStatus


@dataclass(frozen=True)
class SendRequest:
    request_id: str
    peer: str
    src_block_ids: tuple[int, ...]  # prefill-side blocks holding the prompt's KV
    dst_block_ids: tuple[int, ...]  # decode-side blocks D reserved (same count)
    num_tokens: int


class _Transfer:
    def __init__(self, req: SendRequest, num_layers: int):
        self.req = req
        self.num_layers = num_layers
        self.state = TransferState.BOOTSTRAPPING
        self.layers_done = 0
        self.error: str | None = None

    def status(self) -> TransferStatus:
        return TransferStatus(self.req.request_id, self.req.peer, self.state, self.layers_done, self.num_layers, self.error)


class _Batch:
    def __init__(self, channel: _Channel, header: BatchHeader, transfers: list[_Transfer]):
        self.channel = channel
        self.header = header
        self.transfers = transfers
        self.plan: list[Chunk] = layer_plan([r.dst_block_ids for r in header.requests])
        self.inflight = 0  # posted messages the waiter has not finished waiting for
        self.error: str | None = None  # set once the batch failed


@dataclass
class _Posted:
    work: object
    batch: _Batch
    keep: torch.Tensor | None  # a gathered copy that must outlive the send
    layer_done: int | None = None  # set on the last message of a layer
    ack: torch.Tensor | None = None  # set on the acknowledgement receive


class _Channel:
    """One decode peer: its pair, batch numbering and the thread that waits on posted messages."""

    def __init__(self, sender: KVSender, peer: str, pair: PairConnection):
        self.sender, self.peer, self.pair = sender, peer, pair
        self.next_seq = 0
        self.batches: list[_Batch] = []
        self.posted: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._wait_loop, name=f"kv-send:{peer}", daemon=True)
        self.thread.start()

    def _wait_loop(self) -> None:
        self.pair.enter_thread()
        while True:
            item = self.posted.get()
            if item is None:
                return
            try:
                self.pair.wait(item.work, f"sending batch {item.batch.header.seq} to {self.peer}")
                ok = True
            except PairBroken:
                ok = False
            self.sender._on_waited(self, item, ok)

    def stop(self) -> None:
        with self.sender._lock:  # no message is posted between closing and the end marker
            self.pair.close()
            self.posted.put(None)


class KVSender(PairEndpoint):
    RANK, SIDE = 0, "prefill"

    def __init__(self, cache, platform, config: KVTransferConfig | None = None):
        super().__init__(cache, platform, config)
        self._transfers: dict[str, _Transfer] = {}
        self._open: list[_Batch] | None = None
        self._next_layer = 0

    def _new_channel(self, peer: str, pair: PairConnection) -> _Channel:
        return _Channel(self, peer, pair)

    # ------------------------------------------------------------------ engine protocol
    def begin_batch(self, requests: list[SendRequest]) -> None:
        if self._open is not None:
            raise RuntimeError("begin_batch called while the previous batch still has layers to send")
        n_layers = self.cache.spec.num_layers
        by_peer: dict[str, list[SendRequest]] = {}
        for r in requests:
            by_peer.setdefault(r.peer, []).append(r)
        opened: list[_Batch] = []
        with self._lock:
            self._validate(requests)
            for peer, reqs in by_peer.items():
                transfers = [_Transfer(r, n_layers) for r in reqs]
                for t in transfers:
                    self._transfers[t.req.request_id] = t
                ch = self._channels.get(peer)
                if ch is None or ch.pair.state is not PairState.READY:
                    why = f"no ready pair to decode peer {peer!r}" + (f" ({ch.pair.state.value}: {ch.pair.error})" if ch else "")
                    self._fail_now(transfers, why)
                    continue
                entries = [RequestEntry(r.request_id, r.num_tokens, tuple(r.dst_block_ids)) for r in reqs]
                batch = _Batch(ch, BatchHeader.for_spec(self.cache.spec, ch.next_seq, entries), transfers)
                try:
                    ch.pair.publish_header(batch.header)
                except PairBroken as e:
                    self._fail_now(transfers, str(e))
                    continue
                ch.next_seq += 1
                ch.batches.append(batch)
                opened.append(batch)
            self._open, self._next_layer = (opened or None), 0

    def save_layer(self, layer: int) -> None:
        """Post layer `layer`'s messages of the open batch (call right after the layer's KV is written)."""
        if self._open is None:
            return
        if layer != self._next_layer:
            raise ValueError(f"save_layer({layer}) out of order: expected layer {self._next_layer}")
        last = layer == self.cache.spec.num_layers - 1
        with self._lock:
            for batch in self._open:
                if batch.error is None:
                    self._post_layer(batch, layer)
                if last and batch.error is None:
                    self._post_ack(batch)
            self._next_layer += 1
            if last:
                self._open = None

    def abort_batch(self, reason: str) -> None:
        """The forward failed midway: its transfers fail, and the pairs break (D was waiting for the rest)."""
        with self._lock:
            batches, self._open = self._open or [], None
        for b in batches:
            b.channel.pair.mark_broken(f"prefill aborted: {reason}")
        with self._lock:
            for b in batches:
                self._fail_batch(b, f"prefill aborted: {reason}")

    def status(self, request_id: str) -> TransferStatus | None:
        with self._lock:
            t = self._transfers.get(request_id)
            return t.status() if t else None

    def pop_finished(self) -> list[TransferStatus]:
        """Transfers that reached DONE or FAILED since the last call (then forgotten)."""
        with self._lock:
            done = [rid for rid, t in self._transfers.items() if t.state.finished]
            return [self._transfers.pop(rid).status() for rid in done]

    # ------------------------------------------------------------------ internals (lock held)
    def _validate(self, requests: list[SendRequest]) -> None:
        bs, nb = self.cache.spec.block_size, self.cache.num_blocks
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("begin_batch: a request id appears twice")
        for r in requests:
            if r.request_id in self._transfers:
                raise ValueError(f"request {r.request_id!r} already has a transfer in progress")
            need = -(-r.num_tokens // bs) if r.num_tokens > 0 else 0
            if need == 0 or len(r.src_block_ids) != need or len(r.dst_block_ids) != need:
                raise ValueError(f"request {r.request_id!r}: {r.num_tokens} tokens need {need} blocks on each side, "
                                 f"got {len(r.src_block_ids)} source and {len(r.dst_block_ids)} destination blocks")
            if not all(0 <= b < nb for b in r.src_block_ids):
                raise ValueError(f"request {r.request_id!r}: source block id out of range 0..{nb - 1}")

    def _post(self, batch: _Batch, work_fn, tensor, **marks) -> bool:
        try:
            work = work_fn(tensor)
        except PairBroken as e:
            self._fail_batches_of(batch.channel, str(e))
            return False
        batch.inflight += 1
        batch.channel.posted.put(_Posted(work, batch, tensor, **marks))
        return True

    def _post_layer(self, batch: _Batch, layer: int) -> None:
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        send = batch.channel.pair.isend
        for i, ch in enumerate(batch.plan):
            src = batch.transfers[ch.request_index].req.src_block_ids[ch.offset : ch.offset + ch.num_blocks]
            last = i == len(batch.plan) - 1
            if not self._post(batch, send, select_blocks(keys, src)):
                return
            if not self._post(batch, send, select_blocks(values, src), layer_done=layer + 1 if last else None):
                return

    def _post_ack(self, batch: _Batch) -> None:
        ack = torch.zeros(len(batch.transfers), dtype=torch.uint8, device=self.device)
        self._post(batch, batch.channel.pair.irecv, ack, ack=ack)

    def _on_waited(self, ch: _Channel, item: _Posted, ok: bool) -> None:
        """Waiter thread: one posted message finished (ok) or failed."""
        with self._lock:
            batch = item.batch
            batch.inflight -= 1
            if not ok:
                self._fail_batches_of(ch, ch.pair.error or "pair broken")
            elif batch.error is None and item.layer_done is not None:
                for t in batch.transfers:
                    t.layers_done, t.state = item.layer_done, TransferState.TRANSFERRING
            elif batch.error is None and item.ack is not None:
                for t, accepted in zip(batch.transfers, item.ack.cpu().tolist()):
                    if accepted == 1:
                        t.state = TransferState.DONE
                    else:
                        t.state, t.error = TransferState.FAILED, f"decode peer {ch.peer!r} rejected the request (not expected, or blocks/shape mismatch)"
                ch.batches.remove(batch)
            self._settle(batch)

    def _fail_batches_of(self, ch: _Channel, reason: str) -> None:
        for b in list(ch.batches):
            self._fail_batch(b, reason)

    def _fail_batch(self, batch: _Batch, reason: str) -> None:
        if batch.error is None:
            batch.error = reason
        self._settle(batch)

    def _settle(self, batch: _Batch) -> None:
        """A failed batch's transfers turn FAILED once none of its messages is still in flight."""
        if batch.error is None or batch.inflight > 0:
            return
        for t in batch.transfers:
            if not t.state.finished:
                t.state, t.error = TransferState.FAILED, batch.error
        if batch in batch.channel.batches:
            batch.channel.batches.remove(batch)

    @staticmethod
    def _fail_now(transfers: list[_Transfer], reason: str) -> None:
        for t in transfers:
            t.state, t.error = TransferState.FAILED, reason
