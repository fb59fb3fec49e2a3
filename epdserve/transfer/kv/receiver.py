"""`KVReceiver`: the decode side — receives a request's KV, layer by layer, into blocks it reserved.

Engine protocol:
    connect(peer, rdzv)            once per prefill peer (a thread per peer does the receiving)
    expect(RecvRequest)            after reserving the request's blocks: BOOTSTRAPPING
    pop_finished()                 each loop iteration: DONE (every layer is in the blocks:
                                   the request may join the decode batch) or FAILED (free the
                                   blocks; nothing of ours writes to them any more)
    cancel(request_id)             withdraw a request whose header has not arrived yet
    quarantined(id) / pop_released()  a FAILED request whose receives outlived the pair's
                                   teardown (HCCL: destroy returned E_AGAIN): its blocks may still
                                   be written until those end or HCCL_EXEC_TIMEOUT passes

Per batch, the peer's thread reads the header (published by P in the pair's store: it waits
on the store for it while a request is expected, and looks every `poll_interval_s` otherwise), checks
each request against what was expected (shape, block ids, token count), posts every receive
of the batch straight into the reserved blocks (rejected requests go to a scratch buffer, so
the stream stays in step with P), waits on them in wire order and acknowledges to P with one
uint8 per request (1 = stored, 0 = rejected).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.endpoint import PairEndpoint
from epdserve.transfer.kv.layout import layer_plan
from epdserve.transfer.kv.links import hop_links, links_into
from epdserve.transfer.kv.messages import SENDER_RANK, BatchHeader
from epdserve.transfer.kv.pair import PairBroken, PairConnection, work_ended
from epdserve.transfer.kv.state import PairState, TransferState, TransferStatus

_IDLE_POLL_S = 0.02  # how often a connecting pair's state is looked at
_HEADER_WAIT_S = 0.1  # one wait on the store for an expected header (it returns as soon as the header is in)
_FOLLOWER_WAIT_S = 1.0  # the same on a rank other than 0, which waits for every header

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecvRequest:
    request_id: str
    peer: str
    block_ids: tuple[int, ...]  # reserved blocks, exactly as many as the prompt needs
    num_tokens: int


class _Expected:
    def __init__(self, req: RecvRequest, num_layers: int, deadline: float):
        self.req = req
        self.num_layers = num_layers
        self.deadline = deadline
        self.state = TransferState.BOOTSTRAPPING
        self.layers_done = 0
        self.error: str | None = None

    def status(self) -> TransferStatus:
        return TransferStatus(self.req.request_id, self.req.peer, self.state, self.layers_done, self.num_layers, self.error)


class _Channel:
    """One prefill peer: its pair and the thread that receives its batches in order."""

    def __init__(self, receiver: KVReceiver, peer: str, pair: PairConnection):
        self.rx, self.peer, self.pair = receiver, peer, pair
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=f"kv-recv:{peer}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.pair.close()
        self.wake.set()

    def _run(self) -> None:
        self.pair.enter_thread()
        rx, cfg, seq = self.rx, self.rx.config, 0
        leader = self.pair.rdzv.leader
        while not self.stopped:
            if leader:
                rx._expire(self.peer)
            state = self.pair.state
            if state is PairState.CONNECTING:
                self.pair.wait_ready(_IDLE_POLL_S)
                continue
            if state is not PairState.READY:
                break
            expecting = rx._expects(self.peer) if leader else True  # another rank expects what rank 0 accepts
            try:
                header = self.pair.poll_header(seq, (_HEADER_WAIT_S if leader else _FOLLOWER_WAIT_S) if expecting else 0.0)
            except PairBroken:
                break
            except ValueError as e:
                self.pair.mark_broken(f"malformed batch header {seq} from {self.peer}: {e}")
                break
            if header is None:
                if not expecting:
                    self.wake.wait(cfg.poll_interval_s)
                    self.wake.clear()
                continue
            if header.seq != seq:
                self.pair.mark_broken(f"batch header numbered {header.seq}, expected {seq}")
                break
            r = self.pair.rdzv
            if (header.p_degree, header.d_degree) != (r.p_degree, r.d_degree):
                self.pair.mark_broken(f"batch header {seq} names P TP{header.p_degree} -> D TP{header.d_degree}, "
                                      f"the pair was built for P TP{r.p_degree} -> D TP{r.d_degree}")
                break
            seq += 1
            if not self._receive(header):
                break
        if leader:
            rx._fail_peer(self.peer, self.pair.error or "pair closed")

    def _receive(self, header: BatchHeader) -> bool:
        """Receive one batch; False when the pair broke (its transfers are failed by the caller).

        D's rank 0 decides which requests it takes (`_accept`) and tells its other ranks; every
        rank receives its links' heads — straight into its blocks when a link carries all of
        them, else through a scratch buffer copied into their place — and checks each link's
        byte count per layer against what its heads need. The other ranks acknowledge to rank 0,
        which acknowledges the batch to P's rank 0 once all are in."""
        rx, pair, r = self.rx, self.pair, self.pair.rdzv
        lead = r.p_degree  # the group rank of D's rank 0
        mismatch = header.spec_mismatch(rx.cache.spec, rx.share)
        works: list[tuple[object, object]] = []  # (work, what to do once it is done, or None)
        waited, posting = 0, True
        accepted: list[_Expected | None] = []
        short: list[str] = []  # byte counts that did not match (every request of the batch fails)
        try:
            if r.leader:
                accepted = rx._accept(self.peer, header, mismatch)
                takes = [a is not None for a in accepted]
                told = torch.tensor(takes, dtype=torch.uint8, device=rx.device)
                works += [(pair.isend(told, lead + s), None) for s in range(1, r.d_degree)]
            else:
                told = torch.zeros(len(header.requests), dtype=torch.uint8, device=rx.device)
                pair.wait(pair.irecv(told, lead), f"batch {header.seq}: rank 0's verdict")
                takes = [bool(t) and mismatch is None for t in told.cpu().tolist()]
                if mismatch is not None:
                    log.warning("KV batch %d from %s refused on rank %d: %s", header.seq, self.peer, rx.share.rank, mismatch)
            works += self._post_receives(header, takes, short, accepted)
            posting = False
            for work, then in works:
                pair.wait(work, f"receiving batch {header.seq} from {self.peer}")
                waited += 1
                if then is not None:
                    then()
            final = [t and not short for t in takes]
            if r.leader:
                for s in range(1, r.d_degree):
                    theirs = torch.zeros(len(header.requests), dtype=torch.uint8, device=rx.device)
                    pair.wait(pair.irecv(theirs, lead + s), f"batch {header.seq}: D rank {s}'s acknowledgement")
                    got = theirs.cpu().tolist()
                    if not all(got[i] for i, t in enumerate(final) if t):
                        short.append(f"D rank {s} did not get every byte its KV heads need")
                    final = [f and bool(g) for f, g in zip(final, got)]
        except PairBroken:  # drain: once these end, nothing writes into the blocks any more
            stuck = pair.drain(w for w, _ in works[0 if posting else waited + 1 :])
            if r.leader:  # the other D ranks' receives are theirs: rank 0 cannot see whether they ended
                rx._fail_accepted(accepted, pair.error or "pair broken", stuck, others=r.d_degree > 1)
            return False
        if r.leader:
            rx._finish(accepted, final, "; ".join(short))
        elif short:
            log.warning("KV batch %d from %s on rank %d: %s", header.seq, self.peer, rx.share.rank, "; ".join(short))
        ack = torch.tensor([1 if f else 0 for f in final], dtype=torch.uint8, device=rx.device)
        to = SENDER_RANK if r.leader else lead
        try:
            pair.wait(pair.isend(ack, to), f"acknowledging batch {header.seq}")
        except PairBroken:
            return False
        return True

    def _post_receives(self, header: BatchHeader, takes: list[bool], short: list[str], accepted) -> list:
        """Post every receive of this rank's links, in wire order (sender.py `_post_layer`): per
        layer, per link, each chunk's K then V, then the link's byte count."""
        rx, pair = self.rx, self.pair
        cache, spec, h = rx.cache, rx.cache.spec, header
        plan = layer_plan([q.dst_block_ids for q in h.requests])
        links = links_into(hop_links(h.num_kv_heads, h.p_degree, h.d_degree), rx.share.rank)
        works, discard = [], None  # discard: one buffer every refused request's messages land in
        for layer in range(h.num_layers):
            for j, link in enumerate(links):
                off, cnt = link.dst_offset(h.num_kv_heads, h.d_degree), len(link.heads)
                whole = off == 0 and cnt == spec.num_kv_heads
                need = 0
                for c in plan:
                    ids = h.requests[c.request_index].dst_block_ids[c.offset : c.offset + c.num_blocks]
                    for tensors in (cache.keys, cache.values):
                        nbytes = c.num_blocks * h.block_bytes(cnt)
                        need += nbytes
                        blocks = tensors[layer][ids[0] : ids[0] + len(ids)]
                        if not takes[c.request_index]:  # kept in step with P, then dropped
                            if discard is None:
                                biggest = max(x.num_blocks for x in plan) * h.block_bytes(max(len(l.heads) for l in links))
                                discard = torch.empty(biggest, dtype=torch.uint8, device=rx.device)
                            works.append((pair.irecv(discard[:nbytes], link.p_rank), None))
                        elif whole:
                            works.append((pair.irecv(blocks, link.p_rank), None))
                        else:
                            scratch = torch.empty(nbytes, dtype=torch.uint8, device=rx.device)
                            works.append((pair.irecv(scratch, link.p_rank), _place(scratch, blocks, off, cnt)))
                count = torch.zeros(1, dtype=torch.int64, device=rx.device)
                last = j == len(links) - 1 and pair.rdzv.leader
                on_layer = (lambda n=layer + 1: rx._progress_layers(accepted, n)) if last else None
                works.append((pair.irecv(count, link.p_rank), _check_count(count, need, link, layer, short, on_layer)))
        return works


def _place(scratch: torch.Tensor, blocks: torch.Tensor, offset: int, num_heads: int):
    """Once `scratch` is in: its heads into their place among the blocks' own."""
    def then():
        n, bs, _, dim = blocks.shape
        blocks[:, :, offset : offset + num_heads].copy_(scratch.view(blocks.dtype).view(n, bs, num_heads, dim))
    return then


def _check_count(count: torch.Tensor, need: int, link, layer: int, short: list[str], on_layer):
    """Once a link's byte count is in: compare it with what its heads need (a shorter message
    leaves the rest of its buffer as it was: gloo, measured, accepts it without a word)."""
    def then():
        got = int(count.item())
        if got != need:
            short.append(f"layer {layer}: P rank {link.p_rank} sent {got} bytes of KV heads "
                         f"{link.heads.start}-{link.heads.stop - 1}, D rank {link.d_rank} needs {need}")
        if on_layer is not None:
            on_layer()
    return then


class _OtherRanksWork:
    """Stands for the other D ranks' receives of a broken batch in a quarantine: never seen to end
    (rank 0 cannot see them), so the bound decides."""

    def is_completed(self) -> bool:
        return False


_OTHER_RANKS = _OtherRanksWork()


class KVReceiver(PairEndpoint):
    PREFILL, SIDE = False, "decode"

    def __init__(self, cache, platform, config: KVTransferConfig | None = None, share=None):
        super().__init__(cache, platform, config, share)
        self._expected: dict[str, _Expected] = {}
        self._quarantine: dict[str, tuple[list, float]] = {}  # request id -> (stuck receives, monotonic bound)

    def _new_channel(self, peer: str, pair: PairConnection) -> _Channel:
        return _Channel(self, peer, pair)

    # ------------------------------------------------------------------ engine protocol
    def expect(self, req: RecvRequest) -> None:
        """Register a request whose blocks are reserved; its KV may now arrive from `req.peer`."""
        bs, nb = self.cache.spec.block_size, self.cache.num_blocks
        need = -(-req.num_tokens // bs) if req.num_tokens > 0 else 0
        if need == 0 or len(req.block_ids) != need:
            raise ValueError(f"request {req.request_id!r}: {req.num_tokens} tokens need {need} blocks, got {len(req.block_ids)}")
        if not all(0 <= b < nb for b in req.block_ids) or len(set(req.block_ids)) != need:
            raise ValueError(f"request {req.request_id!r}: block ids must be distinct and in 0..{nb - 1}")
        exp = _Expected(req, self.cache.spec.num_layers, time.monotonic() + self.config.bootstrap_timeout_s)
        with self._lock:
            if req.request_id in self._expected:
                raise ValueError(f"request {req.request_id!r} is already expected")
            ch = self._channels.get(req.peer)
            if ch is None or ch.pair.state not in (PairState.CONNECTING, PairState.READY):
                exp.state = TransferState.FAILED
                exp.error = f"no pair to prefill peer {req.peer!r}" + (f" ({ch.pair.state.value}: {ch.pair.error})" if ch else "")
            self._expected[req.request_id] = exp
        if ch is not None:
            ch.wake.set()

    def cancel(self, request_id: str) -> bool:
        """Withdraw a request still BOOTSTRAPPING (True); False once its KV is arriving or finished."""
        with self._lock:
            exp = self._expected.get(request_id)
            if exp is None or exp.state is not TransferState.BOOTSTRAPPING:
                return False
            del self._expected[request_id]
            return True

    def status(self, request_id: str) -> TransferStatus | None:
        with self._lock:
            exp = self._expected.get(request_id)
            return exp.status() if exp else None

    def pop_finished(self) -> list[TransferStatus]:
        """Transfers that reached DONE or FAILED since the last call (then forgotten)."""
        with self._lock:
            done = [rid for rid, e in self._expected.items() if e.state.finished]
            return [self._expected.pop(rid).status() for rid in done]

    # ------------------------------------------------------------------ called by channel threads
    def _expects(self, peer: str) -> bool:
        with self._lock:
            return any(e.req.peer == peer and e.state is TransferState.BOOTSTRAPPING for e in self._expected.values())

    def _expire(self, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            for e in self._expected.values():
                if e.req.peer == peer and e.state is TransferState.BOOTSTRAPPING and now > e.deadline:
                    e.state = TransferState.FAILED
                    e.error = f"no KV from prefill peer {peer!r} within {self.config.bootstrap_timeout_s} s"

    def _accept(self, peer: str, header: BatchHeader, mismatch: str | None) -> list[_Expected | None]:
        """Match a header's requests with what was expected; mismatched expected ones fail."""
        out: list[_Expected | None] = []
        with self._lock:
            for entry in header.requests:
                exp = self._expected.get(entry.request_id)
                if exp is None or exp.req.peer != peer or exp.state is not TransferState.BOOTSTRAPPING:
                    out.append(None)
                    continue
                why = mismatch
                if why is None and tuple(entry.dst_block_ids) != tuple(exp.req.block_ids):
                    why = f"sender targets blocks {list(entry.dst_block_ids)}, reserved {list(exp.req.block_ids)}"
                if why is None and entry.num_tokens != exp.req.num_tokens:
                    why = f"sender has {entry.num_tokens} tokens, expected {exp.req.num_tokens}"
                if why is not None:
                    exp.state, exp.error = TransferState.FAILED, why
                    out.append(None)
                    continue
                exp.state = TransferState.TRANSFERRING
                out.append(exp)
        return out

    def _progress_layers(self, accepted: list[_Expected | None], layers: int) -> None:
        """Rank 0: `layers` layers of the batch's accepted requests are in on this rank."""
        with self._lock:
            for e in accepted:
                if e is not None:
                    e.layers_done = layers

    def _finish(self, accepted: list[_Expected | None], final: list[bool], why: str) -> None:
        """Rank 0: every rank has the batch (or said what it lacks): DONE where all of them got
        every byte, else FAILED (retryable: nothing of it is used)."""
        with self._lock:
            for e, ok in zip(accepted, final):
                if e is None or e.state.finished:
                    continue
                if ok:
                    e.state = TransferState.DONE
                else:
                    e.state, e.error = TransferState.FAILED, f"incomplete KV: {why or 'a D rank refused the batch'}"

    def _fail_accepted(self, accepted: list[_Expected | None], reason: str, stuck: list | None = None,
                       others: bool = False) -> None:
        """Fail a batch's requests. `stuck`: receives the drain left running — where the platform
        bounds how long they may still write (HCCL: `stuck_work_bound_s`), every accepted request
        of the batch is quarantined: its blocks stay out of the free list until they end or the
        bound passes (`pop_released`). `others`: the instance's other ranks received into the same
        blocks, and whether their receives ended is theirs to see, not rank 0's — so on such a
        platform the batch is held until the bound, whatever rank 0's own receives did."""
        bound = self.platform.stuck_work_bound_s() if stuck or others else None
        unseen = [_OTHER_RANKS] if others and bound is not None else []
        until = time.monotonic() + bound if bound is not None else None
        with self._lock:
            for e in accepted:
                if e is not None and not e.state.finished:
                    e.state, e.error = TransferState.FAILED, reason
                    if until is not None:
                        self._quarantine[e.req.request_id] = (list(stuck or []) + unseen, until)

    # ------------------------------------------------------------------ quarantine
    def quarantined(self, request_id: str) -> bool:
        """May a receive that outlived its pair still write into this request's blocks?"""
        with self._lock:
            return request_id in self._quarantine

    def pop_released(self) -> list[str]:
        """Quarantined requests whose stuck receives have ended, or whose bound has passed: their
        blocks may be reused now (then forgotten)."""
        now = time.monotonic()
        with self._lock:
            done = [rid for rid, (works, until) in self._quarantine.items()
                    if now >= until or all(work_ended(w) for w in works)]
            for rid in done:
                del self._quarantine[rid]
        return done

    def unbounded_quarantine(self) -> str | None:
        """Why this process should be restarted, or None: requests held in a quarantine with no
        bound (HCCL_EXEC_TIMEOUT=0 or unparsable: `stuck_work_bound_s` is inf) whose stuck receives
        have not ended. Their blocks are never reused, and only the process's end frees them and
        the communicator those receives run on."""
        with self._lock:
            stuck = [rid for rid, (works, until) in self._quarantine.items()
                     if until == float("inf") and not all(work_ended(w) for w in works)]
        if not stuck:
            return None
        return (f"{len(stuck)} request(s) hold KV blocks a stuck receive may still write "
                f"({', '.join(sorted(stuck)[:3])}{', ...' if len(stuck) > 3 else ''}), with no bound "
                f"(HCCL_EXEC_TIMEOUT={os.environ.get('HCCL_EXEC_TIMEOUT', '')!r} never times out): restart to free them")

    def _fail_peer(self, peer: str, reason: str) -> None:
        with self._lock:
            for e in self._expected.values():
                if e.req.peer == peer and not e.state.finished:
                    e.state, e.error = TransferState.FAILED, reason
