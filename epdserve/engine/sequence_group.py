"""Sequence groups: a request with n > 1 choices (`SamplingParams.n`), its prompt prefilled once.

The request's own `Sequence` is choice 0 and carries a `ChoiceGroup` (the generators of choices
1..n-1, seeded `seed + j`, `choice_seed`: what the fronts gave the n requests a group replaces,
so a seeded group reproduces them) until it forks. The prompt is computed once, as one
sequence. At the step that samples its first token the sampler draws n tokens from the same
last-position logits row, after bias, penalties and the grammar's mask, each with its own choice's
generator (engine/sampler.py `draw_choices`: the row is the same for every choice, whose outputs
are all still empty), returned in the step's result (`StepResult.choices`). The scheduler's
update first calls `fork`, which makes choices 1..n-1: each a `Sequence` with the
internal id ``<id>-c<j>`` (block tables, the scheduler's queues) whose outputs say request
``<id>``, `index` j (`Sequence.output_id`, `RequestOutput.index`). A choice shares the parent's
full prompt blocks by reference count; the partial last block (the one the choices go on writing)
is copied on the device into a block of its own before the next forward (`Scheduler.fork` puts
the copy in the next step's `block_copies`, engine/step_contract.py), so no shared block is ever written, and a block is freed when its last holder lets it go. From there
each choice is an ordinary sequence: its own stop checks and detokenization, its own grammar
matcher (a fresh one; it replays its own output), its own penalty counts and logprobs; preempted,
it is recomputed from the prompt and its own output (prompt embeddings and positions are the
parent's, shared read-only). A group that ends before its first token (an error, an abort) ends
every choice: each of the n choices gets exactly one finished output (`unforked_ends`).

Split modes: the prefill side draws the n first tokens the same way but forks nothing (`Forker`);
its KV crosses to the decode side once. The decode side reserves the choices with the request
(`Scheduler.reserve_choices`: the full prompt blocks shared, the rest each its own) and starts
them when the KV and the n first tokens are in (`FinishedTransfer.choice_tokens`), each copying
the prompt's partial last block (`Scheduler.block_copies`, copied before the next forward) and
sampling on with its own generator (seed + j + 1, as a decode side continues a remote sampler).
"""
from __future__ import annotations

import time


from epdserve.engine.outputs import RequestOutput
from epdserve.engine.request_parts import Handoff, PrefixMemo
from epdserve.engine.sequence import RequestState, Sequence
from epdserve.request_errors import InvalidRequestError


def child_id(request_id: str, j: int) -> str:
    """The internal id of choice j (> 0) of `request_id`."""
    return f"{request_id}-c{j}"


def check(seq: Sequence, in_flight, max_num_seqs: int) -> None:
    """Refuse a group this engine cannot run (InvalidRequestError), a group whose choices' ids
    are taken, or a request whose id a group in flight keeps for one of its choices (ValueError)."""
    parent, sep, j = seq.request_id.rpartition("-c")
    owner = in_flight.get(parent) if sep and j.isdigit() else None
    if owner is not None and owner.group is not None and 0 < int(j) < owner.group.n:
        raise ValueError(f"request id {seq.request_id!r} is kept for a choice of {parent!r}, in flight")
    n = seq.params.n
    if n == 1:
        return
    if n > max_num_seqs:
        raise InvalidRequestError(f"n={n} exceeds this engine's max_num_seqs ({max_num_seqs})")
    clash = [child_id(seq.request_id, j) for j in range(1, n) if child_id(seq.request_id, j) in in_flight]
    if clash:
        raise ValueError(f"request id {clash[0]!r} (a choice of {seq.request_id!r}) is already in flight")


class Forker:
    """Forks a step's groups into their choices (the scheduler's update calls it first, while
    every parent still holds its blocks)."""

    def __init__(self, scheduler, grammars):
        """On a prefill-only engine (`hands_off`) nothing forks: choices 1..n-1 end here with their
        first token (handed off, or finished by it), which go to the decode side with the one KV
        transfer; the decode side made their sequences when it reserved the KV
        (`Scheduler.reserve_choices`) and starts them when it arrives."""
        self.scheduler = scheduler
        self.grammars = grammars  # the engine's GrammarBackend: each choice's own matcher (not the engine: no cycle)

    def choice_matcher(self, seq: Sequence):
        """A forked choice's own grammar matcher (what add_request gives a request; the grammar is
        compiled by then, the parent's)."""
        c = seq.params.structured
        return self.grammars.matcher(c, seq.prompt_token_ids[seq.prompt_len - c.replay_prompt_tokens:]
                                     if c.replay_prompt_tokens else ())

    def fork(self, step, result) -> list[Sequence]:
        """The choices forked by `step` (its `StepResult`), each with its first token (some
        already finished)."""
        out: list[Sequence] = []
        for row, forks in zip(step.rows, result.choices):
            parent = row.seq
            if not forks:
                continue
            if parent.state is not RequestState.RUNNING:  # it ends unforked (`unforked_ends`)
                continue
            group, parent.group = parent.group, None
            now = time.time()
            for j, (tok, logprob) in enumerate(forks, 1):
                child = self.child(parent, j, group.generators[j - 1])
                if self.scheduler.config.hands_off:  # prefill side: the first token goes, with the KV, to D
                    child.output_token_ids.append(tok)
                    child.output_logprobs += [logprob] if logprob is not None else []
                    child.timings.setdefault("first_token", now)
                    self.scheduler.stop_checker.update(child)
                    child.state = RequestState.FINISHED if child.finish_reason else RequestState.HANDED_OFF
                    out.append(child)
                    continue
                self.scheduler.fork(parent, child)
                child.output_token_ids.append(tok)
                if logprob is not None:
                    child.output_logprobs.append(logprob)
                child.timings.setdefault("first_token", now)
                self.scheduler.stop_checker.update(child)
                if child.finish_reason is not None:
                    self.scheduler.finish(child)
                out.append(child)
        return out

    def child(self, parent: Sequence, j: int, generator) -> Sequence:
        """Choice j of `parent`: its prompt (shared, read-only) and what was computed of it, no output."""
        bs = self.scheduler.block_size
        memo = parent.prefix
        child = Sequence(
            child_id(parent.request_id, j), parent.prompt_token_ids, parent.params, media=list(parent.media),
            arrival=parent.arrival, tenant=parent.tenant, positions=parent.positions, rope_delta=parent.rope_delta,
            prompt_embeds=parent.prompt_embeds, generator=generator, timings=dict(parent.timings),
            group_id=parent.request_id, choice=j, handoff=Handoff(vision_tokens=parent.handoff.vision_tokens),
            prefix=PrefixMemo(memo.cache_salt, memo.media_identity, memo.media_spans,
                              list(memo.block_hashes[: parent.prompt_len // bs]), memo.cached_tokens,
                              counted=True, pinned_tokens=memo.pinned_tokens),
        )
        if parent.grammar is not None:
            child.grammar = self.choice_matcher(child)
        return child


def unforked_ends(seq: Sequence) -> list[RequestOutput]:
    """A group that ended before its choices forked: the end of choices 1..n-1 (no tokens)."""
    if seq.group is None or not seq.state.done:
        return []
    g, seq.group = seq.group, None
    return [RequestOutput(seq.output_id, [], "", [], "", True, finish_reason=seq.finish_reason, error=seq.error,
                          retryable=seq.retryable, num_prompt_tokens=seq.prompt_len, index=j) for j in range(1, g.n)]
