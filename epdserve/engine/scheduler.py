"""Continuous-batching scheduler: which requests run this step and how many tokens each.

Policy per step, under a token budget (`max_num_batched_tokens`) and a request cap:
1. every running request that is decoding gets one token (blocks grown as needed; if the free
   list runs dry the newest running request is preempted: its blocks are freed and it is
   recomputed later — nothing is lost);
2. running requests in the middle of a chunked prefill continue;
3. waiting requests are admitted in arrival order while budget, cap and blocks allow; a prompt
   longer than the remaining budget is chunked.
The scheduler talks only to the block manager; it never touches tensors.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from epdserve.engine.block_manager import BlockManager
from epdserve.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token index computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """A token is sampled when this step reaches the last known token of the request."""
        return self.end == self.seq.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool = True):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a request whose KV is already in its blocks (decode-only role)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        # 1. decodes (oldest first, so preemption takes the newest)
        for seq in sorted((s for s in self.running if not s.in_prefill), key=lambda s: s.arrival):
            if seq not in self.running:
                continue  # preempted below by an older request's growth
            while not self.blocks.can_grow(seq.request_id, seq.num_tokens):
                victim = self._newest_running(exclude=seq)
                if victim is None:
                    break
                self._preempt(victim)
                out = [s for s in out if s.seq is not victim]
            if not self.blocks.can_grow(seq.request_id, seq.num_tokens):
                self._preempt(seq)
                continue
            self.blocks.grow(seq.request_id, seq.num_tokens)
            out.append(ScheduledSeq(seq, seq.num_tokens - 1, 1))
            budget -= 1
        # 2. chunked prefills in progress
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            item = self._prefill_chunk(seq, budget)
            if item:
                out.append(item)
                budget -= item.num_tokens
        # 3. admissions
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.chunked_prefill and seq.num_tokens - seq.num_computed_tokens > budget and out:
                break
            item = self._prefill_chunk(seq, budget if self.chunked_prefill else max(budget, seq.num_tokens))
            if item is None:
                break  # not enough free blocks: wait for running requests to finish
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(item)
            budget -= item.num_tokens
        return out

    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        start = seq.num_computed_tokens
        n = min(budget, seq.num_tokens - start)
        if n <= 0 or not self.blocks.can_grow(seq.request_id, start + n):
            return None
        self.blocks.grow(seq.request_id, start + n)
        return ScheduledSeq(seq, start, n)

    def _newest_running(self, exclude: Sequence) -> Sequence | None:
        cands = [s for s in self.running if s is not exclude]
        return max(cands, key=lambda s: s.arrival) if cands else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
