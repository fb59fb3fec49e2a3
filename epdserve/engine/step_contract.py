"""The step contract: what the scheduler plans for one forward, and what the forward returns.

Three calls make a step (vLLM v1's shape), and nothing else passes between them:
    step = Scheduler.schedule(...)          a `ScheduledStep`: frozen rows and block copies
    result = ModelRunner.execute(step)      a `StepResult`: returned fields only
    outputs = Scheduler.update(step, result)   forks, appended tokens, stops, frees
The runner writes nothing into the scheduler's objects; the scheduler never touches tensors.

A row (`StepRow`) is one request's part of the step: its id, the token span [start, end) computed
now, its block table, and `sample_row`, its index among the step's rows that sample a token (None
for a prompt chunk that ends before the prompt does). `ScheduledStep.block_copies` is every
(source, destination) block copy the step needs before its forward, in one list: a forked
choice's copy of its prompt's partial last block, whether it forked here (engine/sequence_group.py)
or its KV arrived from a prefill side. Both blocks of a copy are held by the block manager until
the step that carries it has run, so neither is handed to another request (or written by a KV
import) before the copy reads it.

`StepRow.seq` is the in-process view of the row's request: the runner reads its step inputs
there (token ids, positions, prompt embeddings, media features, sampling parameters and
generator, grammar state) and never assigns to it. Everything else in a row is plain integers and
strings: what a tensor-parallel rank 0 sends the other ranks (issue 47 item 2) is the rows less
`seq`, plus those inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepRow:
    request_id: str
    start: int  # first token index computed this step
    num_tokens: int
    block_ids: tuple[int, ...]  # the request's block table for this step
    sample_row: int | None  # index among the step's sampling rows; None: nothing sampled
    seq: Any = field(compare=False, repr=False)  # the request (engine/sequence.Sequence), read-only here

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """A token is sampled when this step reaches the request's last known token."""
        return self.sample_row is not None

    def slots(self, block_size: int) -> list[int]:
        """Flat cache slots of the tokens computed this step."""
        t = self.block_ids
        return [t[p // block_size] * block_size + p % block_size for p in range(self.start, self.end)]


@dataclass(frozen=True)
class ScheduledStep:
    rows: tuple[StepRow, ...]
    block_copies: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, spans, block_copies=()) -> "ScheduledStep":
        """Rows from (seq, start, num_tokens, block table) spans, in order: a span samples when it
        reaches its request's last known token, and sampling rows are numbered in row order."""
        rows, k = [], 0
        for seq, start, n, table in spans:
            samples = start + n == seq.num_tokens
            rows.append(StepRow(seq.request_id, start, n, tuple(table), k if samples else None, seq))
            k += samples
        return cls(tuple(rows), tuple(block_copies))

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def sampling(self) -> list[StepRow]:
        """The rows that sample, in sample-row order."""
        return [r for r in self.rows if r.sample_row is not None]

    @property
    def decode_only(self) -> bool:
        """Every row decodes one token after its prompt (the step a captured graph can replay)."""
        return all(r.num_tokens == 1 and r.samples and r.start >= r.seq.prompt_len for r in self.rows)


@dataclass(frozen=True)
class StepResult:
    """Per row of the step, in row order: the sampled token (None where the row sampled nothing),
    its `TokenLogprob` when the request asks for logprobs, and for a group at its first token
    (n > 1) the first (token, TokenLogprob or None) of choices 1..n-1; plus the host time spent
    building the step's inputs (EngineStats)."""

    tokens: tuple[int | None, ...]
    logprobs: tuple[Any, ...]
    choices: tuple[tuple[tuple[int, Any], ...] | None, ...]
    inputs_s: float = 0.0
