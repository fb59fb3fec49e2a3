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

import os
import threading
import time
from dataclasses import dataclass

import torch

from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.endpoint import PairEndpoint
from epdserve.transfer.kv.layout import layer_plan
from epdserve.transfer.kv.messages import BatchHeader
from epdserve.transfer.kv.pair import PairBroken, PairConnection, work_ended
from epdserve.transfer.kv.state import PairState, TransferState, TransferStatus

_IDLE_POLL_S = 0.02  # how often a connecting pair's state is looked at
_HEADER_WAIT_S = 0.1  # one wait on the store for an expected header (it returns as soon as the header is in)


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
        while not self.stopped:
            rx._expire(self.peer)
            state = self.pair.state
            if state is PairState.CONNECTING:
                self.pair.wait_ready(_IDLE_POLL_S)
                continue
            if state is not PairState.READY:
                break
            expecting = rx._expects(self.peer)
            try:
                header = self.pair.poll_header(seq, _HEADER_WAIT_S if expecting else 0.0)
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
            seq += 1
            if not self._receive(header):
                break
        rx._fail_peer(self.peer, self.pair.error or "pair closed")

    def _receive(self, header: BatchHeader) -> bool:
        """Receive one batch; False when the pair broke (its transfers are failed by the caller)."""
        rx, pair = self.rx, self.pair
        accepted = rx._accept(self.peer, header)
        cache, plan = rx.cache, layer_plan([r.dst_block_ids for r in header.requests])
        scratch = None
        if not all(accepted):
            biggest = max(c.num_blocks for c in plan) * header.block_bytes()
            scratch = torch.empty(biggest, dtype=torch.uint8, device=rx.device)
        works = []  # (work, layer count complete once it is done, or None)
        waited, posting = 0, True
        try:
            for layer in range(header.num_layers):
                for i, c in enumerate(plan):
                    ids = header.requests[c.request_index].dst_block_ids[c.offset : c.offset + c.num_blocks]
                    for kind, tensors in enumerate((cache.keys, cache.values)):
                        if accepted[c.request_index] is not None:
                            dst = tensors[layer][ids[0] : ids[0] + len(ids)]
                        else:
                            dst = scratch[: c.num_blocks * header.block_bytes()]
                        done = layer + 1 if kind == 1 and i == len(plan) - 1 else None
                        works.append((pair.irecv(dst), done))
            posting = False
            for work, done in works:
                pair.wait(work, f"receiving batch {header.seq} from {self.peer}")
                waited += 1
                if done is not None:
                    rx._progress(accepted, done)
        except PairBroken:  # drain: once these end, nothing writes into the blocks any more
            stuck = pair.drain(w for w, _ in works[0 if posting else waited + 1 :])
            rx._fail_accepted(accepted, pair.error or "pair broken", stuck)
            return False
        rx._progress(accepted, header.num_layers, done=True)
        ack = torch.tensor([0 if a is None else 1 for a in accepted], dtype=torch.uint8, device=rx.device)
        try:
            pair.wait(pair.isend(ack), f"acknowledging batch {header.seq} to {self.peer}")
        except PairBroken:
            return False
        return True


class KVReceiver(PairEndpoint):
    RANK, SIDE = 1, "decode"

    def __init__(self, cache, platform, config: KVTransferConfig | None = None):
        super().__init__(cache, platform, config)
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

    def _accept(self, peer: str, header: BatchHeader) -> list[_Expected | None]:
        """Match a header's requests with what was expected; mismatched expected ones fail."""
        mismatch = header.spec_mismatch(self.cache.spec)
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

    def _progress(self, accepted: list[_Expected | None], layers: int, done: bool = False) -> None:
        with self._lock:
            for e in accepted:
                if e is not None:
                    e.layers_done = layers
                    if done:
                        e.state = TransferState.DONE

    def _fail_accepted(self, accepted: list[_Expected | None], reason: str, stuck: list | None = None) -> None:
        """Fail a batch's requests. `stuck`: receives the drain left running — where the platform
        bounds how long they may still write (HCCL: `stuck_work_bound_s`), every accepted request
        of the batch is quarantined: its blocks stay out of the free list until they end or the
        bound passes (`pop_released`)."""
        bound = self.platform.stuck_work_bound_s() if stuck else None
        until = time.monotonic() + bound if bound is not None else None
        with self._lock:
            for e in accepted:
                if e is not None and not e.state.finished:
                    e.state, e.error = TransferState.FAILED, reason
                    if until is not None:
                        self._quarantine[e.req.request_id] = (list(stuck), until)

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
