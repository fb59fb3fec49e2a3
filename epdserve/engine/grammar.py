"""Grammars of structured outputs (xgrammar): compiled once per constraint, one matcher per
request, the allowed-token bitmask applied to the logits before sampling.

- `tokenizer_info(tokenizer, vocab_size, stop_ids)`: xgrammar's view of the model's vocabulary
  (the logits' width). Special tokens other than the stop tokens (<|im_start|>, <|image_pad|>,
  ...) and the padding rows past the tokenizer are never allowed: xgrammar treats tokens with
  an empty string as special, so they are blanked here.
- `check(constraint)`: the constraint parsed without a tokenizer (the scheduler's check, for both
  fronts: a bad schema, regex or grammar is INVALID_ARGUMENT / 400 before any instance sees it).
- `GrammarBackend`: one engine's compiler. `matcher(constraint)` compiles a `StructuredOutput`
  (cached: an LRU keyed by the tokenizer's fingerprint, the kind and the spec text, so a schema
  is compiled once per engine, bounded in bytes — `cache_bytes`, each entry counted at
  xgrammar's `memory_size_bytes` — so a flood of big schemas evicts, never grows the process) and
  returns a fresh `GrammarState`. A constraint xgrammar cannot compile (a bad schema, regex or
  grammar), or whose compiled grammar is over `max_grammar_bytes` (then never cached), raises
  InvalidRequestError naming the limit. The engine compiles off
  its loop (engine/grammar_compile.py: `cached`, `compile_uncached` on a worker, `add`, `state`);
  `compile` / `matcher` are the synchronous path (tools, benchmarks). A resumed attempt (a retry elsewhere, or a client's
  resume_token_ids: the output so far joins the prompt) replays the prompt's last
  `replay_prompt_tokens` into the new matcher. JSON is compact (xgrammar's `any_whitespace=False`, vLLM's
  `disable_any_whitespace`): no whitespace between tokens, so a model cannot spend its tokens on
  blanks; `json_object` is the schema {"type": "object"}.
- `GrammarState`: a matcher and how many of the request's output tokens it has consumed. Before
  each token is sampled, `sync(output_token_ids)` feeds it the tokens it has not seen: the one
  this engine sampled last step, or, on a decode side, the first token the prefill side sampled
  (a fresh matcher replays the tokens so far — exact, and one `accept_token` per replayed
  token). A terminated matcher (it accepted a stop token) ignores what follows and allows only
  stop tokens from then on (with ignore_eos the output goes on with stop tokens to max_tokens).
- `TokenMasker` (one per engine, the model runner's): each step, `sync_states` feeds every
  matcher its new token (one batched xgrammar call for the usual one token per row), xgrammar's
  batched fill writes the constrained rows of a bitmask preallocated once, and xgrammar applies
  it — its C++ kernel on CPU, Triton on CUDA, its plain torch ops (shift, and, masked_fill)
  on NPU and any other device. `mask_logits(logits, rows)`: the same for one call.
"""
from __future__ import annotations

import json
import logging
import re

import torch
from cachetools import LRUCache

from epdserve.engine.structured_output import StructuredOutput
from epdserve.request_errors import InvalidRequestError

log = logging.getLogger(__name__)



def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids):
    """xgrammar.TokenizerInfo of a Hugging Face tokenizer for logits `vocab_size` wide."""
    import xgrammar as xgr

    stops = sorted(stop_token_ids)
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    special = set(getattr(tokenizer, "all_special_ids", ())) - set(stops)
    encoded = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and idx not in special:
            encoded[idx] = token
    return xgr.TokenizerInfo(encoded, vocab_type=base.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=base.add_prefix_space)


def check(c: StructuredOutput) -> None:
    """Parse `c` without a tokenizer (fast: no vocabulary is walked); InvalidRequestError saying what
    is wrong. The scheduler runs it for both fronts before any instance sees the request."""
    import xgrammar as xgr

    try:
        if c.kind == "json":
            xgr.Grammar.from_json_schema(c.spec, any_whitespace=False, strict_mode=True)
        elif c.kind == "regex":
            xgr.Grammar.from_regex(c.spec)
        elif c.kind in ("choice", "grammar"):
            xgr.Grammar.from_ebnf(_choice_grammar(json.loads(c.spec)) if c.kind == "choice" else c.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(_why(c, e)) from None


def _why(c: StructuredOutput, e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(e).strip())
    return f"the {c.kind} structured output cannot be compiled: {text}"


def _choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the choices (xgrammar's string literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher; `accepted`: how many of its output tokens it has consumed; `live`:
    the matcher takes tokens (neither terminated nor rejected: kept here, so the step asks
    xgrammar only when a stop token was accepted)."""

    def __init__(self, matcher):
        self.accepted = 0
        self.rejected: str | None = None  # a replayed token the grammar refused (see `sync`)
        self.matcher = None  # None while the grammar compiles (engine/grammar_compile.py)
        self.live, self.stops = False, frozenset()
        if matcher is not None:
            self.attach(matcher)

    def attach(self, matcher) -> None:
        """The matcher, once its grammar is compiled (it may have consumed a replay)."""
        self.matcher, self.stops = matcher, frozenset(matcher.stop_token_ids)
        self.live = not matcher.is_terminated()

    def sync(self, output_token_ids) -> None:
        """Feed the matcher the output tokens it has not seen yet."""
        for i in range(self.accepted, len(output_token_ids)):
            if self.matcher.is_terminated() or self.rejected:
                break
            if not self.matcher.accept_token(output_token_ids[i]):
                self.reject(i, output_token_ids[i])
        self.accepted = len(output_token_ids)
        self.live = not self.rejected and not self.matcher.is_terminated()

    def accepted_one(self, token: int, ok: bool) -> None:
        """The batched accept (`sync_states`) fed the matcher `token`; `ok`: it took it."""
        if not ok:
            self.reject(self.accepted, token)
            self.live = False
        elif token in self.stops:
            self.live = not self.matcher.is_terminated()
        self.accepted += 1

    def reject(self, i: int, token: int) -> None:
        """Output token `i` was refused: cannot happen for tokens sampled under this grammar; a
        peer that compiled the grammar differently (another tokenizer) could. The request is
        ended (stop tokens only)."""
        self.rejected = f"output token {i} ({token}) does not follow the grammar"
        log.error("structured output: %s; ending the request", self.rejected)

    @property
    def ready(self) -> bool:
        """The grammar is compiled: the request may be scheduled (engine/scheduler.py checks)."""
        return self.matcher is not None

    @property
    def completed(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return self.matcher.is_terminated() or self.matcher.is_completed()


class GrammarBackend:
    """One engine's grammar compiler (built on first use: xgrammar is imported only then)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_bytes: int, max_grammar_bytes: int):
        """`cache_bytes`, `max_grammar_bytes`: EngineConfig's `grammar_cache_bytes`, `max_grammar_bytes`."""
        self._tokenizer, self.vocab_size, self._stops = tokenizer, vocab_size, set(stop_token_ids)
        self._fingerprint = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), vocab_size, tuple(sorted(self._stops)))
        self._compiler = None
        self._info = None
        self.max_grammar_bytes = min(max_grammar_bytes, cache_bytes)
        self._cache: LRUCache = LRUCache(maxsize=cache_bytes, getsizeof=lambda g: max(1, g.memory_size_bytes))
        self.compiles = 0  # cache misses (tests, benchmarks)

    def key(self, c: StructuredOutput) -> tuple:
        return (self._fingerprint, c.kind, c.spec)

    def cached(self, c: StructuredOutput):
        """The compiled grammar of `c` if it is in the cache, else None."""
        return self._cache.get(self.key(c))

    @property
    def cache_bytes(self) -> int:
        """Bytes of the compiled grammars cached now (xgrammar's memory_size_bytes)."""
        return int(self._cache.currsize)

    def add(self, c: StructuredOutput, compiled):
        """Cache `compiled` (the grammar of `c`, compiled by `compile_uncached`); returns it.
        InvalidRequestError, nothing cached, when it is over `max_grammar_bytes`."""
        size = compiled.memory_size_bytes
        if size > self.max_grammar_bytes:
            raise InvalidRequestError(
                f"the {c.kind} structured output compiles to {size / 2**20:.1f} MiB, over this engine's limit of "
                f"{self.max_grammar_bytes / 2**20:.0f} MiB (--max-grammar-mb): simplify it (fewer enum values or "
                f"alternatives)")
        self._cache[self.key(c)] = compiled
        self.compiles += 1
        return compiled

    def compile(self, c: StructuredOutput):
        """The compiled grammar of `c`, from the cache or compiled now (synchronously)."""
        compiled = self.cached(c)
        return compiled if compiled is not None else self.add(c, self.compile_uncached(c))

    def matcher(self, c: StructuredOutput, replay=()) -> GrammarState:
        """A fresh matcher for `c` that has consumed `replay` (a resumed attempt's output so far,
        the prompt's tail); InvalidRequestError when the grammar refuses one of them."""
        return self.state(self.compile(c), c, replay)

    @staticmethod
    def state(compiled, c: StructuredOutput, replay=()) -> GrammarState:
        """A fresh matcher of the compiled grammar of `c`, `replay` consumed (see `matcher`)."""
        import xgrammar as xgr

        m = xgr.GrammarMatcher(compiled)
        for i, t in enumerate(replay):
            if not m.is_terminated() and not m.accept_token(int(t)):
                raise InvalidRequestError(f"resumed output token {i} ({t}) does not follow the {c.kind} structured output")
        return GrammarState(m)

    def prepare(self) -> None:
        """Build the compiler (xgrammar's view of the vocabulary) if not built yet."""
        import xgrammar as xgr

        if self._compiler is None:
            self._info = tokenizer_info(self._tokenizer, self.vocab_size, self._stops)
            self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)  # the LRU above is the cache

    def compile_uncached(self, c: StructuredOutput):
        """Compile `c` (no cache: it touches neither the cache nor a matcher, so a worker thread
        may run it; `prepare` once under a lock first); InvalidRequestError when xgrammar refuses it."""
        self.prepare()
        return compile_constraint(self._compiler, c)

    def info_json(self) -> str:
        """xgrammar's view of the vocabulary, as JSON (a compile process builds its compiler from it)."""
        self.prepare()
        return self._info.serialize_json()

    def deserialize(self, text: str):
        """A compiled grammar from xgrammar's JSON (what a compile process returns)."""
        import xgrammar as xgr

        self.prepare()
        return xgr.CompiledGrammar.deserialize_json(text, self._info)


def compile_constraint(compiler, c: StructuredOutput):
    """`c` compiled by an xgrammar GrammarCompiler with the engine's rules (no whitespace freedom,
    strict JSON schemas); InvalidRequestError when xgrammar refuses it."""
    try:
        if c.kind in ("json", "json_object"):
            schema = c.spec if c.kind == "json" else '{"type": "object"}'
            return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if c.kind == "regex":
            return compiler.compile_regex(c.spec)
        if c.kind == "choice":
            return compiler.compile_grammar(_choice_grammar(json.loads(c.spec)))
        return compiler.compile_grammar(c.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(_why(c, e)) from None


class TokenMasker:
    """One engine's grammar mask: a bitmask preallocated once (xgrammar's layout, on the host,
    grown only if a step samples more rows than it has) that xgrammar's batched fill writes and
    xgrammar's kernel applies. `backend`: "cpu" (xgrammar's C++ kernel) for CPU logits, "triton"
    for CUDA logits when triton is installed, else "torch_native" (xgrammar's plain torch ops:
    shift, and, masked_fill — NPU and any other device; its own "auto" would pick torch.compile
    for devices it does not know). Off the CPU the bitmask is copied into a device twin (one copy
    of the step's rows)."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", rows: int = 8,
                 backend: str | None = None, max_threads: int | str = "auto"):
        import xgrammar as xgr

        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.backend = backend or _backend_for(self.device)
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self._stop_rows: dict[tuple[int, ...], torch.Tensor] = {}  # stop-only rows, per stop set
        self._alloc(rows)

    def _alloc(self, rows: int) -> None:
        import xgrammar as xgr

        self.bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        if self.device.type == "cuda":
            self.bitmask = self.bitmask.pin_memory()
        self._device_bitmask = None if self.device.type == "cpu" else torch.empty_like(self.bitmask, device=self.device)

    def __call__(self, logits: torch.Tensor, rows: list[tuple[int, "GrammarState", list[int]]]) -> None:
        """In place: each (row, state, output tokens so far) of `logits` [N, V] keeps only the
        tokens its grammar allows next (the others become -inf)."""
        if rows:
            sync_states(rows)
            self.fill(rows, logits.shape[0])
            self.apply(logits, rows)

    def fill(self, rows: list[tuple[int, "GrammarState", list[int]]], n: int) -> None:
        """The bitmask's rows for synced states (of a step with `n` logits rows): xgrammar's
        batched fill for the live matchers, the stop-only row for terminated / rejected ones."""
        if n > self.bitmask.shape[0]:
            self._alloc(max(n, 2 * self.bitmask.shape[0]))
        live, live_rows = [], []
        for r, state, _ in rows:
            if not state.live:
                self.bitmask[r].copy_(self._stop_row(state.stops))
            else:
                live.append(state.matcher)
                live_rows.append(r)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, self.bitmask, live_rows)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, "GrammarState", list[int]]]) -> None:
        """The filled rows applied to `logits` (on its device, with `backend`'s kernel)."""
        import xgrammar as xgr

        n, bitmask = logits.shape[0], self.bitmask
        if self._device_bitmask is not None:
            self._device_bitmask[:n].copy_(self.bitmask[:n], non_blocking=True)
            bitmask = self._device_bitmask
        indices = [r for r, _, _ in rows]
        if len(indices) == n:  # every row constrained (rows are distinct): no index list to walk
            indices = None
        xgr.apply_token_bitmask_inplace(logits, bitmask[:n], vocab_size=min(self.vocab_size, logits.shape[-1]),
                                        indices=indices, backend=self.backend)

    def _stop_row(self, stop_ids) -> torch.Tensor:
        key = tuple(sorted(stop_ids))
        row = self._stop_rows.get(key)
        if row is None:
            row = self._stop_rows[key] = torch.zeros(self.bitmask.shape[1], dtype=torch.int32)
            for t in key:
                bit = t % 32
                row[t // 32] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32's sign bit
        return row


def _backend_for(device: torch.device) -> str:
    """xgrammar's kernel for logits on `device` (see TokenMasker)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        import importlib.util

        return "triton" if importlib.util.find_spec("triton") is not None else "torch_native"
    return "torch_native"


def sync_states(rows: list[tuple[int, "GrammarState", list[int]]]) -> None:
    """Every state fed the output tokens it has not seen: the usual step's one new token per
    live matcher in one batched call (xgrammar's batch_accept_token); a state already in sync
    costs a comparison; anything else (a replay, a terminated or rejected matcher) through
    `GrammarState.sync`."""
    import xgrammar as xgr

    one, tokens = [], []
    for _, state, out in rows:
        behind = len(out) - state.accepted
        if behind == 1 and state.live:
            one.append(state)
            tokens.append(out[-1])
        elif behind:
            state.sync(out)
    if not one:
        return
    for state, ok, tok in zip(one, xgr.BatchGrammarMatcher.batch_accept_token([s.matcher for s in one], tokens),
                              tokens):
        state.accepted_one(tok, ok)


def mask_logits(logits: torch.Tensor, rows: list[tuple[int, GrammarState, list[int]]]) -> None:
    """`TokenMasker` for one call (tests, tools): allocates its bitmask each time; an engine keeps one."""
    if rows:
        TokenMasker(logits.shape[-1], logits.device, rows=logits.shape[0])(logits, rows)
