"""Continuous-batching scheduler: the one owner of the block manager and of request states.

`schedule()` picks this step's work under a token budget (`max_num_batched_tokens`, and the
step-time budget's prefill tokens when given) and a request cap:
1. every running request that is decoding gets one token (blocks grown as needed; if the free
   list runs dry the newest running request of the tenant holding the greatest share is
   preempted: its blocks are freed and it is recomputed later — nothing is lost);
2. running requests in the middle of a chunked prefill continue;
3. waiting requests are admitted while budget, cap and blocks allow — the next one from the tenant
   holding the least share of the running sequences, in queue order within a tenant
   (engine/fair_share.py; a tenant alone is served in arrival order, and under
   `--scheduling-policy fcfs` every request is the default tenant's; a request whose grammar
   still compiles is passed over); a prompt longer than the remaining budget is chunked. On a
   full engine that computes whole requests (no KV connector), the request picked may displace
   other tenants' newest decoding sequences where that evens the shares
   (`fair_share.fairness_victims`; preempted, recomputed later).
A request whose structured output's grammar is still compiling is neither admitted nor decoded
(the others pass it) until it is ready (engine/grammar_compile.py).
A request whose media are still arriving (pipelined prefill, engine/pipelined_prefill.py) is
prefilled only up to its `prefill_limit`; it waits there, running, until the limit rises.
With a prefix cache (`BlockManager(prefix_caching=True)` and a `PrefixHasher`), a request about
to be admitted first takes the longest cached run of its prompt's full blocks
(`reuse_prefix`), and every step records the hashes of the full blocks it computed.
A remote-KV request (decode role) takes its cached prefix at `add`, so that only the rest of its
prompt's KV is imported (the connector is told through `num_remote_tokens` /
`on_blocks_allocated`); the KV it imports is hashed like computed KV and serves later imports.
`schedule()` returns a frozen `ScheduledStep` (engine/step_contract.py): the rows, and every block
copy pending. `update(step, result)` is the step's postprocessing, from the runner's returned
`StepResult`: a group's choices fork, computed counts, appended tokens, stop checks, finishing
(blocks freed, or held while the KV connector still uses them); `step_failed` when the forward raised.
A request with n choices counts n against `max_num_seqs` from its admission; at its first token
its choices fork (`fork`, engine/sequence_group.py) sharing its full prompt blocks.
`poll_connector()` applies the connector's finished transfers: received KV starts a request's
decode, finished sends free held blocks. The scheduler never touches tensors.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from epdserve.engine import fair_share
from epdserve.engine.block_manager import BlockManager
from epdserve.engine.prefix_hash import PrefixHasher
from epdserve.engine.sequence import RequestState, Sequence
from epdserve.engine.sequence_group import Forker
from epdserve.engine.step_contract import ScheduledStep, StepResult
from epdserve.engine.stop_checker import StopChecker
from epdserve.engine.turns import Turns
from epdserve.seams.kv_connector import FinishedTransfer, KVConnector

S = RequestState


@dataclass(frozen=True)
class StepSchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool = True
    hands_off: bool = False  # prefill-only: a request's part here ends with its first token


class Scheduler:
    def __init__(self, config: StepSchedulerConfig, blocks: BlockManager, stop_checker: StopChecker,
                 connector: KVConnector | None = None, hasher: PrefixHasher | None = None, grammars=None):
        self.config = config
        self._blocks = blocks
        self.hasher = hasher if blocks.prefix_caching else None
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens whose KV was reused
        self.stop_checker = stop_checker
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV
        self.held: dict[str, Sequence] = {}  # KV_HELD
        self.remote_choices: dict[str, list[Sequence]] = {}  # a remote-KV group's choices 1..n-1, until its KV is in
        self.block_copies: list[tuple[int, int]] = []  # (source, destination), both held: for the next step
        self.num_preemptions = 0
        self.num_fair_preemptions = 0  # of those, sequences displaced for another tenant's (fair share)
        self._admitted = Turns()  # tenants by their latest admission (engine/fair_share.py)
        self.forker = Forker(self, grammars)  # n > 1: a group's choices at its first token

    # ---------------------------------------------------------------- requests in / out
    def add(self, seq: Sequence) -> None:
        """Queue a request to be computed here (a remote-KV request's blocks are reserved now)."""
        remote = self.connector.num_remote_tokens(seq) if self.connector else 0
        if not remote:
            seq.state = S.WAITING
            self.waiting.append(seq)
            return
        total = min(seq.prompt_len + seq.params.max_tokens, self.stop_checker.max_model_len)
        rid = seq.request_id
        self.reuse_prefix(seq)  # a prefix imported here before: only the rest arrives (on_blocks_allocated)
        # n > 1: its choices share the full prompt blocks and reserve the rest (reserve_choices)
        choices = (seq.params.n - 1) * (self._blocks.blocks_needed(total) - seq.prompt_len // self._blocks.block_size)
        if not self._blocks.can_grow(rid, total, reserve=choices):
            self._blocks.free(rid)
            raise MemoryError(f"not enough free KV blocks for {seq.params.n} x {total} tokens "
                              f"({self._blocks.num_free} free)")
        table = self._blocks.grow(rid, total)  # whole request up front: an imported one is never preempted
        try:
            self.connector.on_blocks_allocated(seq, list(table))
        except ValueError:
            self._blocks.free(rid)
            raise
        seq.state = S.WAITING_FOR_REMOTE_KV
        self.remote[rid] = seq

    def reuse_prefix(self, seq: Sequence) -> int:
        """Start a request that holds no blocks yet on the longest cached prefix of its prompt
        (whole blocks, at least one prompt token left to compute); returns the tokens reused."""
        if self.hasher is None or self._blocks.table(seq.request_id) or seq.num_computed_tokens:
            return 0
        bs = self._blocks.block_size
        hashes = self.hasher.hashes(seq, seq.num_tokens)
        blocks = self._blocks.lookup(hashes)[:(seq.num_tokens - 1) // bs]
        if not blocks:
            return 0
        self._blocks.adopt(seq.request_id, blocks)
        seq.num_computed_tokens = seq.prefix.cached_tokens = len(blocks) * bs
        return seq.prefix.cached_tokens

    def _count_prefix(self, seq: Sequence) -> None:
        """A request's first admission: its prompt queried the prefix cache, its cached tokens hit
        (once per request, however often it was looked up or preempted)."""
        if self.hasher is not None and not seq.prefix.counted:
            seq.prefix.counted = True
            self.prefix_queried_tokens += seq.prompt_len
            self.prefix_hit_tokens += seq.prefix.cached_tokens

    def abort(self, seq: Sequence) -> None:
        """Stop a request wherever it is (blocks freed, or held while a transfer uses them)."""
        if seq.state.done:
            return
        seq.finish_reason = "abort"
        self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        """The request is done here: out of the queues; blocks freed or handed to the connector."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.remote.pop(seq.request_id, None)
        for child in self.remote_choices.pop(seq.request_id, []):  # a remote group ended before its KV came
            if not child.state.done:
                child.finish_reason, child.error, child.retryable = seq.finish_reason, seq.error, seq.retryable
                self.finish(child)
        if self.connector is not None and self.connector.request_finished(seq):
            seq.state = S.KV_HELD
            self.held[seq.request_id] = seq
            return
        self._blocks.free(seq.request_id)
        seq.state = S.FINISHED if seq.finish_reason is not None else S.HANDED_OFF

    def fail(self, seq: Sequence, message: str, retryable: bool = False) -> None:
        seq.error, seq.finish_reason, seq.retryable = message, "error", retryable
        self.finish(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child`, a choice of `parent` forked at its first token (engine/sequence_group.py):
        it shares the parent's full prompt blocks; the partial last one is copied into a block of
        its own before the next forward (`block_copies`). With no block free, the choice waits to
        recompute its last partial block, like a preempted request."""
        bs, p = self._blocks.block_size, parent.prompt_len
        table = self._blocks.table(parent.request_id)
        self._blocks.adopt(child.request_id, list(table[: p // bs]))
        if p % bs and not self._blocks.can_grow(child.request_id, p):
            child.num_computed_tokens = p // bs * bs
            child.state = S.WAITING
            self.waiting.appendleft(child)
            return
        if p % bs:
            self._copy_block(table[p // bs], self._blocks.grow(child.request_id, p)[p // bs])
        child.num_computed_tokens = p
        child.state = S.RUNNING
        self.running.append(child)

    def reserve_choices(self, parent: Sequence, children: list[Sequence]) -> None:
        """Decode side, n > 1: the KV of `parent` (reserved, expected) serves its choices too. Each
        choice shares its full prompt blocks and reserves its own for the rest, up front like the
        parent (an imported request is never preempted); MemoryError (nothing kept) without room."""
        bs, p = self._blocks.block_size, parent.prompt_len
        total = min(p + parent.params.max_tokens, self.stop_checker.max_model_len)
        shared = list(self._blocks.table(parent.request_id)[: p // bs])
        need = len(children) * (self._blocks.blocks_needed(total) - len(shared))
        if need > self._blocks.num_free:
            raise MemoryError(f"not enough free KV blocks for {len(children) + 1} choices of {total} tokens "
                              f"({self._blocks.num_free} free)")
        for child in children:
            self._blocks.adopt(child.request_id, shared)
            self._blocks.grow(child.request_id, total)
            child.state = S.WAITING_FOR_REMOTE_KV
        self.remote_choices[parent.request_id] = children

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy `src` into `dst` before the next forward; both are held until that step has run
        (nothing else gets them, nothing imports into them, before the copy reads them)."""
        self._blocks.hold((src, dst))
        self.block_copies.append((src, dst))

    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    # ---------------------------------------------------------------- queries
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_transfers(self) -> bool:
        return bool(self.remote or self.held)

    def load(self) -> dict[str, int]:
        return {
            "free_kv_blocks": self._blocks.num_free,
            "total_kv_blocks": self._blocks.num_blocks,
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self.remote),
            "queued_tokens": sum(s.num_tokens - s.num_computed_tokens for s in self.waiting),
            "held": len(self.held),
        }

    # ---------------------------------------------------------------- the step
    def decoding(self) -> list[Sequence]:
        """Running requests past their prefill: each gets one token per step."""
        return [s for s in self.running if not s.in_prefill]

    def oldest_prefill_arrival(self) -> float:
        """Arrival order of the oldest request with prompt tokens to compute (inf: none)."""
        return min([s.arrival for s in self.running if s.in_prefill] + [s.arrival for s in self.waiting],
                   default=float("inf"))

    def prefill_tokens_waiting(self) -> int:
        """Prompt tokens still to compute, running chunked prefills and waiting requests."""
        return sum(s.num_tokens - s.num_computed_tokens for s in self.running if s.in_prefill) + \
            sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)

    def schedule(self, prefill_budget: int | None = None) -> ScheduledStep:
        """This step's work (engine/step_contract.py): its rows, and every block copy pending;
        `prefill_budget` caps the prefill tokens beside the decodes (engine/step_budget.py), None:
        only `max_num_batched_tokens` does."""
        budget = self.config.max_num_batched_tokens
        out: list[tuple[Sequence, int, int, list[int]]] = []  # (request, start, tokens, block table)
        # 1. decodes (oldest first, so preemption takes the newest)
        for seq in sorted((s for s in self.running if not s.in_prefill and _grammar_ready(s)), key=lambda s: s.arrival):
            if seq not in self.running:
                continue  # preempted below by an older request's growth
            while not self._blocks.can_grow(seq.request_id, seq.num_tokens):
                victim = self._preemption_victim(exclude=seq)
                if victim is None:
                    break
                self._preempt(victim)
                out = [span for span in out if span[0] is not victim]
            if not self._blocks.can_grow(seq.request_id, seq.num_tokens):
                self._preempt(seq)
                continue
            out.append((seq, seq.num_tokens - 1, 1, self._blocks.grow(seq.request_id, seq.num_tokens)))
            budget -= 1
        if prefill_budget is not None:
            budget = min(budget, prefill_budget)
        # 2. chunked prefills in progress
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            span = self._prefill_chunk(seq, budget)
            if span:
                out.append(span)
                budget -= span[2]
        # 3. admissions
        chunked = self.config.chunked_prefill
        width = sum(s.width for s in self.running)  # a group counts its n choices from its admission
        while self.waiting and budget > 0:
            seq = fair_share.next_admission(self.waiting, self.running, _grammar_ready, self._admitted.last)
            if seq is None:
                break
            if width + seq.width > self.config.max_num_seqs:
                victims = self._displace_for(seq, width + seq.width - self.config.max_num_seqs)
                if not victims:
                    break
                budget += sum(span[2] for span in out if span[0] in victims)
                out = [span for span in out if span[0] not in victims]
                width = sum(s.width for s in self.running)
            if not chunked and seq.num_tokens - seq.num_computed_tokens > budget and out:
                break
            self.reuse_prefix(seq)
            span = self._prefill_chunk(seq, budget if chunked else max(budget, seq.num_tokens))
            if span is None:
                break  # not enough free blocks: wait for running requests to finish
            self.waiting.remove(seq)
            self._admitted.served(seq.tenant.name)
            self._count_prefix(seq)
            seq.state = S.RUNNING
            self.running.append(seq)
            width += seq.width
            out.append(span)
            budget -= span[2]
        step = ScheduledStep.of(out, self.block_copies)
        self.block_copies = []
        if step.rows and self.connector is not None:
            self.connector.build_step(step.rows)
        return step

    def step_failed(self, step: ScheduledStep, message: str) -> list[Sequence]:
        """The forward of `step` raised: its requests fail (retryable), its copies' blocks go."""
        self._blocks.release(b for pair in step.block_copies for b in pair)
        failed = [row.seq for row in step.rows if not row.seq.state.done]
        for seq in failed:
            self.fail(seq, message, retryable=True)
        return failed

    def update(self, step: ScheduledStep, result: StepResult) -> list[Sequence]:
        """Apply one forward's results: a group's choices fork, tokens are appended, stops
        checked, finished requests' blocks freed (or held for the connector). Returns the
        requests with a new token or a new end, the new choices first."""
        self._blocks.release(b for pair in step.block_copies for b in pair)  # copied: the holds go
        touched = self.forker.fork(step, result)
        touched += self.poll_connector()  # a send refused or finished in this step is known before finishing
        now = time.time()
        for row, tok, logprob in zip(step.rows, result.tokens, result.logprobs):
            seq = row.seq
            seq.num_computed_tokens = row.end
            if self.hasher is not None:  # a block that filled up may serve later prompts
                self._cache_full_blocks(seq, row.end)
            if tok is None or seq.state is not S.RUNNING:
                continue
            seq.output_token_ids.append(tok)
            if logprob is not None:
                seq.output_logprobs.append(logprob)
            if len(seq.output_token_ids) == 1:
                seq.timings.setdefault("first_token", now)
            elif seq.handoff.kv_transfer is not None:
                seq.timings.setdefault("first_decode", now)
            self.stop_checker.update(seq)
            touched.append(seq)
            if seq.finish_reason is None and self.config.hands_off:
                if seq.handoff.kv_error is not None:
                    self.fail(seq, f"KV transfer to the decode side failed: {seq.handoff.kv_error}", retryable=True)
                else:
                    self.finish(seq)  # handed off: the decode side goes on
            elif seq.finish_reason is not None:
                self.finish(seq)
        return touched

    def poll_connector(self) -> list[Sequence]:
        """Apply finished transfers; returns requests whose state changed visibly (failed/finished)."""
        if self.connector is None:
            return []
        sent, received = self.connector.get_finished()
        changed = []
        for ft in sent + received:
            seq = self.held.pop(ft.request_id, None)
            if seq is not None:  # done here already: the blocks are free to go
                self._blocks.free(seq.request_id)
                seq.state = S.FINISHED if seq.finish_reason is not None else S.HANDED_OFF
            elif ft.request_id in self.remote:
                changed.extend(self._received(self.remote.pop(ft.request_id), ft))
        for ft in sent:
            seq = next((s for s in self.running if s.request_id == ft.request_id), None)
            if seq is not None and ft.error is not None:
                seq.handoff.kv_error = ft.error
        return changed

    # ---------------------------------------------------------------- internals
    def _received(self, seq: Sequence, ft: FinishedTransfer) -> list[Sequence]:
        children = [c for c in self.remote_choices.pop(seq.request_id, []) if not c.state.done]
        if ft.error is None and ft.first_token is not None and len(ft.choice_tokens) < len(children):
            ft = FinishedTransfer(ft.request_id, f"{len(ft.choice_tokens)} choice first tokens for "
                                                 f"{len(children) + 1} choices")
        if ft.error is not None or ft.first_token is None:
            for s in [seq] + children:
                self.fail(s, f"KV transfer failed: {ft.error or 'no first token'}", retryable=True)
            return [seq] + children
        changed = [c for c in children if self._start_choice(seq, c, ft)]
        return changed + self._start_received(seq, ft)

    def _start_choice(self, parent: Sequence, child: Sequence, ft: FinishedTransfer) -> bool:
        """A choice of a received group starts on its own first token (P's); the prompt's partial
        last block is copied into its own. True when that token already ended it."""
        bs, p = self._blocks.block_size, parent.prompt_len
        if self._start_received(child, FinishedTransfer(ft.request_id, None, ft.choice_tokens[child.choice - 1],
                                                        ft.rope_delta)):
            return True
        if p % bs:  # copied before the next forward, while no one has written it
            self._copy_block(self._blocks.table(parent.request_id)[p // bs], self._blocks.table(child.request_id)[p // bs])
        return False

    def _start_received(self, seq: Sequence, ft: FinishedTransfer) -> list[Sequence]:
        seq.timings["kv_transfer_end"] = time.time()
        seq.rope_delta = ft.rope_delta
        seq.num_computed_tokens = seq.prompt_len
        seq.output_token_ids = [ft.first_token]
        seq.emitted.tokens = 1  # the prefill side streamed it
        self.stop_checker.update(seq)
        seq.emitted.text_len = len(seq.text)
        if seq.finish_reason is not None:
            self.finish(seq)
            return [seq]
        seq.state = S.RUNNING
        self.running.append(seq)
        return []

    def _prefill_chunk(self, seq: Sequence, budget: int) -> tuple[Sequence, int, int, list[int]] | None:
        start = seq.num_computed_tokens
        end = seq.num_tokens if seq.prefill_limit is None else min(seq.num_tokens, seq.prefill_limit)
        n = min(budget, end - start)
        if n <= 0 or not self._blocks.can_grow(seq.request_id, start + n):
            return None
        table = self._blocks.grow(seq.request_id, start + n)
        seq.timings.setdefault("prefill_start", time.time())
        return seq, start, n, table

    def _cache_full_blocks(self, seq: Sequence, computed: int) -> None:
        """Hash the request's full blocks among its `computed` tokens into the prefix cache, once a
        new one has filled (each block's hash is taken once)."""
        if computed // self._blocks.block_size > self._blocks.uncached_from(seq.request_id):
            self._blocks.cache(seq.request_id, self.hasher.hashes(seq, computed))

    def _preemption_victim(self, exclude: Sequence) -> Sequence | None:
        return fair_share.preemption_victim(self.running, exclude)

    def _displace_for(self, seq: Sequence, room: int) -> list[Sequence]:
        """Fair share, on an engine that computes whole requests: preempt other tenants' newest
        sequences so `room` more fit for `seq`, where that evens the shares (engine/fair_share.py)."""
        if self.config.hands_off or self.connector is not None:
            return []
        victims = fair_share.fairness_victims(seq, self.running, room, lambda s: not s.in_prefill)
        for v in victims:
            self._preempt(v)
            self.num_fair_preemptions += 1
        return victims

    def _preempt(self, seq: Sequence) -> None:
        """Back to waiting, recomputed later; a pinned prefix (its media never encoded here) keeps
        its blocks, the rest may come back from the prefix cache."""
        self.running.remove(seq)
        self._blocks.truncate(seq.request_id, seq.prefix.pinned_tokens // self._blocks.block_size)
        seq.num_computed_tokens = seq.prefix.pinned_tokens
        seq.state = S.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _grammar_ready(seq: Sequence) -> bool:
    """A request whose structured output is still compiling (engine/grammar_compile.py) waits:
    not admitted, not decoded (a decode side's request may get its KV first)."""
    return seq.grammar is None or seq.grammar.ready
