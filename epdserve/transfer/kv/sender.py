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

Tensor parallelism: every rank of a P instance holds a `KVSender` over its own cache and joins
the pair's group (messages.py `PairRendezvous`). Rank 0 opens each batch (`begin_batch`:
publishes the header, returns what it opened) and its other ranks follow it (`follow`, with
what rank 0 opened, sent to them with the forward's inputs); each rank then sends, per layer, on
each of its links (links.py) the KV heads that link carries, followed by one int64 — the bytes it
sent on that link for that layer — so D checks that the bytes it got are the bytes its heads
need. Only rank 0 hears D's acknowledgement: D's rank 0 gives it once every D rank got all its
heads, so a DONE on rank 0 means every rank's sends were received and their blocks may be reused.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.endpoint import PairEndpoint
from epdserve.transfer.kv.layout import Chunk, layer_plan, select_blocks
from epdserve.transfer.kv.links import Link, links_from
from epdserve.transfer.kv.messages import BatchHeader, RequestEntry
from epdserve.transfer.kv.pair import PairBroken, PairConnection
from epdserve.transfer.kv.state import PairState, TransferState, TransferStatus

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class OpenedBatch:
    """A batch P's rank 0 opened for one decode peer: what its other ranks send alongside it."""

    peer: str
    header: BatchHeader
    src_block_ids: tuple[tuple[int, ...], ...]  # per request of the header: the prefill-side blocks


class _Batch:
    def __init__(self, channel: _Channel, header: BatchHeader, transfers: list[_Transfer], src_block_ids,
                 links: list[Link]):
        self.channel = channel
        self.header = header
        self.transfers = transfers  # empty on a following rank (rank 0 alone tracks the requests)
        self.src_block_ids = src_block_ids
        self.links = links  # what this rank sends on
        self.plan: list[Chunk] = layer_plan([r.dst_block_ids for r in header.requests])
        self.inflight = 0  # posted messages the waiter has not finished waiting for
        self.posted_all = False  # the last layer (and, on rank 0, the acknowledgement) is posted
        self.counts: dict[int, torch.Tensor] = {}  # a link's byte count -> the tensor that sends it (made once)
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
    PREFILL, SIDE = True, "prefill"

    def __init__(self, cache, platform, config: KVTransferConfig | None = None, share=None):
        super().__init__(cache, platform, config, share)
        self._transfers: dict[str, _Transfer] = {}
        self._open: list[_Batch] | None = None
        self._next_layer = 0
        self.bytes_sent = 0  # KV bytes this rank posted (every layer's K and V of its links)

    def _new_channel(self, peer: str, pair: PairConnection) -> _Channel:
        return _Channel(self, peer, pair)

    # ------------------------------------------------------------------ engine protocol
    def begin_batch(self, requests: list[SendRequest]) -> list[OpenedBatch]:
        """Open one batch per decode peer (rank 0): returns what was opened, for the other ranks."""
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
                rdzv = ch.pair.rdzv
                header = BatchHeader.for_spec(self.cache.spec, ch.next_seq, entries, self.share, rdzv.d_degree)
                batch = _Batch(ch, header, transfers, tuple(tuple(r.src_block_ids) for r in reqs),
                               links_from(self.links(rdzv), self.share.rank))
                try:
                    ch.pair.publish_header(batch.header)
                except PairBroken as e:
                    self._fail_now(transfers, str(e))
                    continue
                ch.next_seq += 1
                ch.batches.append(batch)
                opened.append(batch)
            self._open, self._next_layer = (opened or None), 0
        return [OpenedBatch(b.channel.peer, b.header, b.src_block_ids) for b in opened]

    def follow(self, opened: list[OpenedBatch]) -> None:
        """Another rank than 0: send this rank's links of the batches rank 0 opened, layer by layer
        (`save_layer`), as rank 0 does. A pair not ready (within the connect timeout) fails only
        here: rank 0's transfer fails when D's ranks miss these bytes."""
        if self._open is not None:  # rank 0's forward never came (it failed before sending it)
            self.abort_batch("the forward of the previous batch never ran on this rank")
        batches = []
        for ob in opened:
            with self._lock:
                ch = self._channels.get(ob.peer)
            if ch is None or not ch.pair.wait_ready(self.config.connect_timeout_s):
                log.warning("KV batch %d to %s not sent from rank %d: %s", ob.header.seq, ob.peer, self.share.rank,
                            "no pair" if ch is None else f"pair {ch.pair.state.value}: {ch.pair.error}")
                continue
            self._validate_sources(ob.src_block_ids)
            batch = _Batch(ch, ob.header, [], ob.src_block_ids, links_from(self.links(ch.pair.rdzv), self.share.rank))
            with self._lock:
                ch.batches.append(batch)
            batches.append(batch)
        with self._lock:
            self._open, self._next_layer = (batches or None), 0

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
                if last and batch.error is None and batch.transfers:
                    self._post_ack(batch)
                if last:
                    batch.posted_all = True
                    self._settle(batch)
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
        bs = self.cache.spec.block_size
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
            self._validate_sources([r.src_block_ids])

    def _validate_sources(self, block_lists) -> None:
        nb = self.cache.num_blocks
        for ids in block_lists:
            if not all(0 <= b < nb for b in ids):
                raise ValueError(f"source block id out of range 0..{nb - 1}")

    def _post(self, batch: _Batch, work_fn, tensor, peer: int, **marks) -> bool:
        try:
            work = work_fn(tensor, peer)
        except PairBroken as e:
            self._fail_batches_of(batch.channel, str(e))
            return False
        batch.inflight += 1
        batch.channel.posted.put(_Posted(work, batch, tensor, **marks))
        return True

    def _post_layer(self, batch: _Batch, layer: int) -> None:
        """Per link, in order: each chunk's K then V of the link's heads, then the bytes sent."""
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        send, h = batch.channel.pair.isend, batch.header
        for j, link in enumerate(batch.links):
            dst, off = h.p_degree + link.d_rank, link.src_offset(h.num_kv_heads, h.p_degree)
            sent = 0
            for ch in batch.plan:
                src = batch.src_block_ids[ch.request_index][ch.offset : ch.offset + ch.num_blocks]
                for tensors in (keys, values):
                    msg = self._message(select_blocks(tensors, src), off, len(link.heads))
                    if not self._post(batch, send, msg, dst):
                        return
                    sent += msg.numel() * msg.element_size()
            self.bytes_sent += sent
            count = batch.counts.get(sent)  # the same every layer: no host-to-device copy per layer
            if count is None:
                count = batch.counts[sent] = torch.tensor([sent], dtype=torch.int64, device=self.device)
            if not self._post(batch, send, count, dst, layer_done=layer + 1 if j == len(batch.links) - 1 else None):
                return

    @staticmethod
    def _message(blocks: torch.Tensor, offset: int, num_heads: int) -> torch.Tensor:
        """One message: the blocks' KV heads [offset, offset + num_heads) of this rank's own."""
        if offset == 0 and num_heads == blocks.shape[2]:
            return blocks
        return blocks[:, :, offset : offset + num_heads].contiguous()

    def _post_ack(self, batch: _Batch) -> None:
        ack = torch.zeros(len(batch.transfers), dtype=torch.uint8, device=self.device)
        self._post(batch, batch.channel.pair.irecv, ack, batch.header.p_degree, ack=ack)

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
        """A failed batch's transfers turn FAILED once none of its messages is still in flight; a
        following rank's batch ends once every message it posted has been waited for."""
        if not batch.transfers and batch.posted_all and batch.inflight == 0 and batch in batch.channel.batches:
            batch.channel.batches.remove(batch)
            return
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
