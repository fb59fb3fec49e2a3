"""LLMEngine: one engine's step loop — encode → schedule → execute → update.

A step is three calls on one contract (engine/step_contract.py): `Scheduler.schedule` plans a
frozen `ScheduledStep`, `ModelRunner.execute` returns a `StepResult`, `Scheduler.update` applies
it (forks, tokens, stops, frees) and names the requests with something new to emit.

Public API (the only way in for workers, transfer and benchmarks):
- `build_request(id, prompt, images, params)`: raw prompt → `EngineRequest` (preprocessing;
  bad input raises InvalidRequestError);
- `add_request(EngineRequest)`: the one intake, for every role. Media go to the encode stage
  first; a request with `kv_transfer=RemotePrefill` gets its blocks reserved now (MemoryError
  if there is no room) and waits for its KV; the rest wait to be scheduled. With pipelined
  prefill (the default), a request whose media are still arriving is scheduled at once, its
  prompt prefilled up to the first item not yet there (engine/pipelined_prefill.py);
- `step()`: encode pending media, schedule, run one packed forward, update; returns
  `RequestOutput`s (a request is `finished` once no more outputs come from this engine). While
  requests decode, the step-time budget (engine/step_budget.py, `slo_tpot_ms`) sizes the step's
  prefill chunk and how many vision blocks of an encode it runs, from costs measured online;
A request with `params.n > 1` is prefilled once and forks into its n choices at its first token
(engine/sequence_group.py); its outputs say which choice (`RequestOutput.index`).
- `abort(id)` (every choice of it), `has_unfinished()`, `has_pending_transfers()`, `load_report()`.
Stages run: `EngineConfig.roles`. KV moves between instances only through the `KVConnector`,
media features through the `FeatureProvider`, both given at construction.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import torch

from epdserve.engine.block_manager import BlockManager
from epdserve.engine.config import EngineConfig
from epdserve.engine.encode_stage import EncodeStage
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.grammar import GrammarBackend
from epdserve.engine.grammar_compile import GrammarCompiles
from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.engine.loaded_model import LoadedModel, load_model
from epdserve.engine.model_runner import ModelRunner
from epdserve.engine.prefix_hash import PrefixHasher
from epdserve.engine import pipelined_prefill
from epdserve.engine.outputs import RequestOutput, make_output
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine import sequence_group
from epdserve.engine.scheduler import Scheduler, StepSchedulerConfig
from epdserve.engine.request_parts import ChoiceGroup, Handoff, MediaItem, PipelineState, PrefixMemo, TenantShare
from epdserve.engine.sequence import RequestState, Sequence
from epdserve.engine.stats import EngineStats
from epdserve.engine.step_budget import StepBudget, StepPlan
from epdserve.engine.stop_checker import StopChecker
from epdserve.engine.tp.encode_dp import DataParallelEncoder
from epdserve.engine.tp.group import RankFailure, TPGroup
from epdserve.engine.tp.shard import TPShard, head_map
from epdserve.kv_layout import KvLayout, KvShare
from epdserve.model.processor import MediaInput
from epdserve.ops.select import layer_ops, paged_ops
from epdserve.request_errors import InvalidRequestError
from epdserve.seams.feature_provider import FeatureProvider, LocalFeatureProvider
from epdserve.seams.kv_connector import KVConnector, RemotePrefill
from epdserve.seams.media_keys import media_key

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None,
                 features: FeatureProvider | None = None, kv_connector: KVConnector | None = None):
        self.config = config
        tp = config.tensor_parallel_size
        self.model = model or load_model(config.model, config.device, config.dtype, config.max_model_len,
                                         shard=TPShard(0, tp), quantization=config.quantization)
        if config.quantization is None and self.model.quantization:  # the checkpoint's own (engine/lm/prequantized.py)
            config.quantization = self.model.quantization
        if (self.model.quantization or None) != config.quantization:
            raise ValueError(f"quantization={config.quantization} but the model was loaded with "
                             f"{self.model.quantization or 'none'}")
        a = self.model.adapter
        self.platform, self.max_model_len = self.model.platform, self.model.max_model_len
        config.block_size = config.block_size or self.platform.kv_block_size  # NPU kernels want 128
        if tp > 1 or self.model.lm.shard.size > 1:
            self._check_tp()
        q_heads, kv_heads = head_map(a.num_heads, a.num_kv_heads, TPShard(0, tp))
        spec = KVCacheSpec(a.num_layers, len(kv_heads), a.head_dim, config.block_size, self.model.dtype)
        num_blocks = spec.blocks_for_budget(config.kv_cache_bytes)
        ops = paged_ops(self.platform, config.ops)
        ops.check_kv_spec(spec, len(q_heads), self.model.device)  # refuse at start-up what the kernels refuse
        self.tp = self._start_tp(num_blocks) if tp > 1 else None
        self.kv_cache = PagedKVCache(spec, num_blocks, self.model.device)
        self.kv_connector = kv_connector
        self.grammars = GrammarBackend(self.model.tokenizer, a.text_config.vocab_size, self.model.eos_token_ids,
                                       config.grammar_cache_bytes, config.max_grammar_bytes)
        if kv_connector is not None:
            if self.tp is not None:  # every rank sends or receives its own KV heads
                kv_connector.span_ranks(KvShare(a.num_kv_heads, tp, 0), self.tp.tell_kv)
            kv_connector.register_kv_cache(self.kv_cache, self.platform)
        self.scheduler = Scheduler(
            StepSchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                            hands_off=not config.decodes),
            BlockManager(num_blocks, config.block_size, prefix_caching=config.enable_prefix_caching),
            StopChecker(self.model.tokenizer, self.model.eos_token_ids, self.max_model_len), kv_connector,
            PrefixHasher(config.block_size, (a.image_token_id, a.video_token_id)), self.grammars,
        )
        self.runner = ModelRunner(a, self.model.lm, self.kv_cache, ops,
                                  layer_ops(self.platform, config.ops), self.platform, kv_connector,
                                  max_batch=config.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager or tp > 1,  # TP decode runs eagerly
                                  decodes=config.decodes)
        self.runner.tp = self.tp
        capture_s = self.runner.capture_graphs()
        if capture_s:
            log.info("captured decode graphs for batch sizes %s in %.2f s", self.runner.graphs.buckets, capture_s)
        self.features = features or LocalFeatureProvider()
        # new grammars compile off the loop (in a child process, within the time budget)
        self.grammar_compiles = GrammarCompiles(self.grammars, timeout_s=config.grammar_compile_timeout_s)
        self.stats = EngineStats()
        # only an engine that decodes has inter-token gaps to protect
        self.budget = (StepBudget(config.slo_tpot_ms / 1000.0, bank=config.step_budget_bank,
                                  horizon=config.step_budget_horizon)
                       if config.step_budget and config.decodes else None)
        self.encoder = EncodeStage(
            a, self.features, encodes=config.encodes, prefills=config.prefills, wait_s=config.feature_wait_s,
            token_budget=config.encode_token_budget, stats=self.stats, budget=self.budget,
            per_item=config.encode_per_item and config.encodes and not config.prefills,
        )
        if self.tp is not None:
            self.encoder.encode = DataParallelEncoder(self.tp, a.encode_images, a.device)
        self._seqs: dict[str, Sequence] = {}
        self._outputs: list[RequestOutput] = []
        self._arrivals = itertools.count()

    def kv_layout(self) -> KvLayout:
        """The registration record of this engine's KV (epdserve/kv_layout.py): the scheduler pairs
        a P with a D only when their records map."""
        a, c = self.model.adapter, self.config
        return KvLayout(c.tensor_parallel_size, a.num_layers, a.num_kv_heads, a.head_dim, c.block_size,
                        self.model.dtype_name, self.model.quantization)

    def _check_tp(self) -> None:
        """Refuse a model loaded for another rank or degree (load_model refused the degrees that
        do not split the model)."""
        tp = self.config.tensor_parallel_size
        if self.model.lm.shard != TPShard(0, tp):
            raise ValueError(f"tensor_parallel_size={tp} but the model was loaded for rank {self.model.lm.shard.rank} "
                             f"of {self.model.lm.shard.size}")

    def _start_tp(self, num_blocks: int) -> TPGroup:
        """Ranks 1..tp-1 started and joined (each reads its own part of the checkpoint); rank 0's
        LM sums over them."""
        c, m = self.config, self.model
        group = TPGroup(self.platform, c.tensor_parallel_size, dict(
            model=c.model, device=c.device, dtype=m.dtype_name, max_model_len=self.max_model_len,
            num_blocks=num_blocks, block_size=c.block_size, max_num_seqs=c.max_num_seqs, ops=c.ops,
            quantization=c.quantization),
            reduce_bytes=c.max_num_seqs * int(m.adapter.text_config.hidden_size) * m.dtype.itemsize)  # a decode step's
        m.lm.reduce = group.reduce
        return group

    tokenizer = property(lambda self: self.model.tokenizer)
    processor = property(lambda self: self.model.processor)

    # ---------------------------------------------------------------- requests in
    def media_item(self, m: MediaInput, key: str | None = None) -> MediaItem:
        """A request's media item from preprocessed media (key computed unless given: an instance
        is given the scheduler's; offline, the key is this process's, `LoadedModel.media_secret`)."""
        return MediaItem(key=key or media_key(m.raw, self.model.namespace, self.model.media_secret), input=m, num_tokens=m.num_tokens,
                         grid_thw=m.grid_thw)

    def build_request(self, request_id: str, prompt: str | list[int], images: list | None = None,
                      params: SamplingParams | None = None, videos: list | None = None,
                      video_options: dict | None = None) -> EngineRequest:
        """Preprocess a raw prompt and its images / videos; InvalidRequestError for bad input."""
        processed = self.processor.process(prompt, images, videos, video_options)
        return EngineRequest(request_id, processed.token_ids, [self.media_item(m) for m in processed.media],
                             params or SamplingParams())

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request (see the module docstring); bad input raises InvalidRequestError."""
        rid = req.request_id
        if rid in self._seqs or rid in self.scheduler.held:
            raise ValueError(f"request id {rid!r} is already in flight")
        seq = Sequence(rid, list(req.prompt_token_ids), req.params, media=list(req.media), arrival=next(self._arrivals),
                       tenant=req.tenant if self.config.scheduling_policy == "fair" else TenantShare(),  # fcfs: one queue
                       handoff=Handoff(req.feature_target, req.kv_transfer, vision_tokens=req.num_vision_tokens),
                       prefix=PrefixMemo(req.cache_salt, tuple(req.media_identity)))
        self._validate(seq)
        self._start_group(seq)
        if req.params.structured is not None and self.config.computes:  # a new grammar: not scheduled until compiled
            c = req.params.structured
            if c.replay_prompt_tokens > seq.prompt_len:
                raise InvalidRequestError(f"replay_prompt_tokens={c.replay_prompt_tokens} exceeds the prompt "
                                          f"({seq.prompt_len} tokens)")
            replay = seq.prompt_token_ids[seq.prompt_len - c.replay_prompt_tokens:] if c.replay_prompt_tokens else ()
            seq.grammar = self.grammar_compiles.start(c, replay, tenant=seq.tenant.name)
        seq.timings["arrival"] = time.time()
        if req.params.seed is not None:  # a decode side continues a remote sampler: another stream
            seed = req.params.seed + (1 if isinstance(req.kv_transfer, RemotePrefill) else 0)
            seq.generator = torch.Generator(device=self.model.device).manual_seed(seed)
        if self.config.prefills:
            seq.positions, seq.rope_delta = self.model.adapter.rope_index(
                seq.prompt_token_ids, [m.grid_thw for m in seq.media],
                [m.input.seconds_per_grid if m.input is not None else None for m in seq.media])
        if seq.media and self.config.prefills and not isinstance(seq.handoff.kv_transfer, RemotePrefill):
            self._skip_cached_media(seq)
        if any(m.features is None for m in seq.media):
            self.encoder.add(seq)
            if self._pipelines(seq):
                self._start_pipeline(seq)
        elif self.config.computes:
            self.scheduler.add(seq)  # may raise MemoryError (remote KV: no room for its blocks)
        else:
            seq.state = RequestState.HANDED_OFF  # encode-only, nothing to encode
            self._outputs.append(make_output(seq))
            return
        self._seqs[rid] = seq
        self._reserve_choices(seq)

    def _pipelines(self, seq: Sequence) -> bool:
        """Is `seq` prefilled while its media still arrive (engine/pipelined_prefill.py)?"""
        return self.config.pipelined_prefill and self.config.prefills and not isinstance(seq.handoff.kv_transfer, RemotePrefill)

    def _start_pipeline(self, seq: Sequence) -> None:
        """Text embeddings now, each item's rows as it lands; scheduled once a token may be computed."""
        a = self.model.adapter
        seq.pipeline = PipelineState.of(seq.prompt_token_ids, seq.media, (a.image_token_id, a.video_token_id))
        seq.prompt_embeds = self.runner.build_prompt_embeds(seq.prompt_token_ids, [])
        self._advance_pipeline(seq)

    def _advance_pipeline(self, seq: Sequence) -> None:
        """Take the items that landed; hand the request to the scheduler once it can compute a token."""
        try:
            pipelined_prefill.advance(seq)
        except ValueError as e:
            self.encoder.remove(seq)
            self.scheduler.fail(seq, f"media features do not fit the prompt: {e}")
            self._emit(seq)
            return
        if seq.state is RequestState.WAITING_FOR_FEATURES and seq.prefill_limit > seq.num_computed_tokens:
            self.scheduler.add(seq)

    def _skip_cached_media(self, seq: Sequence) -> None:
        """Media wholly inside the prompt's cached prefix are neither encoded nor fetched: their
        tokens' KV is reused, so their embeddings are never computed (zeros stand in for them).
        That prefix is pinned: a preemption keeps its blocks, which nothing could recompute."""
        if not self.scheduler.reuse_prefix(seq):
            return
        spans = seq.prefix.media_spans or []
        hidden, depth = self.model.adapter.hidden_size, 1 + self.model.adapter.num_deepstack
        zero = torch.zeros(1, hidden, dtype=self.model.dtype, device=self.model.device)
        covered = 0
        for m, (_, _, _, end) in zip(seq.media, spans):
            if end > seq.prefix.cached_tokens:
                break
            m.features, m.from_store = [zero.expand(m.num_tokens, hidden)] * depth, True
            covered = end
        seq.prefix.pinned_tokens = seq.prefix.cached_tokens if covered else 0

    def _validate(self, seq: Sequence) -> None:
        visual = (self.model.adapter.image_token_id, self.model.adapter.video_token_id)
        n_img = sum(1 for t in seq.prompt_token_ids if t in visual)
        n_media = sum(m.num_tokens for m in seq.media)
        if self.config.prefills and n_img != n_media:
            raise InvalidRequestError(f"{n_img} image/video tokens in the prompt but media for {n_media}")
        if self.config.computes and seq.prompt_len >= self.max_model_len:
            raise InvalidRequestError(f"prompt is {seq.prompt_len} tokens; the model's context is {self.max_model_len}")

    def _start_group(self, seq: Sequence) -> None:
        """n > 1: the choices' generators, kept until they fork (engine/sequence_group.py)."""
        sequence_group.check(seq, self._seqs, self.config.max_num_seqs)
        n = seq.params.n
        if n == 1:
            return
        if not self.config.computes:
            raise InvalidRequestError(f"n={n}: this engine's role ({self.config.roles}) computes no tokens")
        if not isinstance(seq.handoff.kv_transfer, RemotePrefill):  # a decode side forks at its KV's arrival instead
            seq.group = ChoiceGroup.of(seq.params.seed, n, self.model.device)

    def _reserve_choices(self, seq: Sequence) -> None:
        """Decode side, n > 1: the choices wait with the request for its one KV import (their
        blocks reserved now, the prompt's shared), each continuing its own remote sampler."""
        if seq.params.n == 1 or not isinstance(seq.handoff.kv_transfer, RemotePrefill):
            return
        seed = seq.params.seed
        gens = ChoiceGroup.of(None if seed is None else seed + 1, seq.params.n, self.model.device)
        children = [self.scheduler.forker.child(seq, j, gens.generators[j - 1]) for j in range(1, seq.params.n)]
        self.scheduler.reserve_choices(seq, children)
        self._seqs.update((c.request_id, c) for c in children)

    def abort(self, request_id: str) -> None:
        """Stop a request (each of its choices); blocks are freed now, or once a transfer still
        using them ends."""
        for seq in [s for s in self._seqs.values() if s.output_id == request_id and not s.state.done]:
            if seq.grammar is not None and not seq.grammar.ready:
                self.grammar_compiles.discard(seq.grammar)
            self.encoder.remove(seq)
            self.scheduler.abort(seq)
            self._emit(seq)

    # ---------------------------------------------------------------- the loop
    def has_unfinished(self) -> bool:
        """Work to compute now (the loop should step again at once). Requests that only wait for
        their grammar's compile are not (`has_pending_transfers`: poll soon, do not spin)."""
        s = self.scheduler
        return bool(self.encoder.pending or self._outputs or s.running
                    or any(q.grammar is None or q.grammar.ready for q in s.waiting))

    def has_pending_transfers(self) -> bool:
        """Requests wait on the KV connector or on a grammar's compile (poll `step` soon, it is
        cheap when idle)."""
        return self.scheduler.has_pending_transfers() or self.grammar_compiles.pending

    def step(self) -> list[RequestOutput]:
        t_start, encode_s = time.perf_counter(), 0.0
        for seq in self.scheduler.poll_connector():
            self._emit(seq)
        if self.grammar_compiles.pending:
            self._grammars_compiled()
        plan = self._plan()
        if self.encoder.pending:
            t = time.perf_counter()
            self._encode_step(plan)
            encode_s = time.perf_counter() - t
        step = self.scheduler.schedule(plan(0, encode_s).prefill_tokens if plan else None)
        if step.rows or step.block_copies:
            self._run(step, t_start + encode_s)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _run(self, step, scheduled_from: float) -> None:
        """Execute `step` and apply its result; a forward that raises fails the step's requests
        (retryable) and the engine goes on."""
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(step)
        except RankFailure:
            raise  # a tensor-parallel rank is gone: the instance ends as a whole (engine/tp/group.py)
        except Exception as e:
            log.exception("engine step failed")
            if self.kv_connector is not None:
                self.kv_connector.abort_step(f"step failed: {e}")
            for seq in self.scheduler.step_failed(step, f"step failed: {e}"):
                self._emit(seq)
            return
        t1 = time.perf_counter()
        if self.budget is not None and step.rows:
            self.budget.record_step(step.num_tokens, t1 - t0)
        for seq in self.scheduler.update(step, result):
            self._seqs.setdefault(seq.request_id, seq)  # a choice forked this step
            self._emit(seq)
        if step.rows:
            self.stats.record_step(step.rows, t0 - scheduled_from, result.inputs_s, t1 - t0 - result.inputs_s,
                                   time.perf_counter() - t1)

    def _grammars_compiled(self) -> None:
        """Requests whose grammar compiled may be scheduled from now; a failed compile fails its
        requests alone (not retryable: the constraint is the request's)."""
        failed = dict((id(state), why) for state, why in self.grammar_compiles.poll())
        for seq in [s for s in self._seqs.values() if s.grammar is not None and id(s.grammar) in failed]:
            if not seq.state.done:
                self.encoder.remove(seq)
                self.scheduler.fail(seq, failed[id(seq.grammar)])
                self._emit(seq)

    def close(self) -> None:
        """Release what the engine runs besides its loop (the grammar compile pool, the
        tensor-parallel ranks)."""
        self.grammar_compiles.close()
        if self.tp is not None:
            self.tp.close()

    def _plan(self) -> Callable[..., StepPlan] | None:
        """This step's plan (engine/step_budget.py): `plan(patches, spent)` for `patches` of encode
        in flight, `spent` seconds of the step already used; None without a budget."""
        if self.budget is None:
            return None
        now, decoding = time.perf_counter(), self.scheduler.decoding()
        for seq in decoding:
            if seq.decode_clock is None:
                seq.decode_clock = (now, len(seq.output_token_ids))
        decode_s = self.budget.decode_cost(len(decoding)) if self.budget.horizon > 1 else None  # only a horizon reads it
        target = self.budget.step_target([(s.decode_clock[0], len(s.output_token_ids) - s.decode_clock[1],
                                           s.params.max_tokens - len(s.output_token_ids)) for s in decoding],
                                         now, decode_s)
        prefill = self.scheduler.prefill_tokens_waiting()
        vision_first = self.encoder.oldest_arrival() < self.scheduler.oldest_prefill_arrival()
        return lambda patches, spent=0.0: self.budget.plan(len(decoding), prefill, patches, target - spent,
                                                           vision_first)

    def _encode_step(self, plan: Callable[[int], StepPlan] | None = None) -> None:
        ready, failed = self.encoder.step((lambda patches: plan(patches).vision_blocks) if plan else None)
        for seq, message in failed:
            self.scheduler.fail(seq, message)
            self._emit(seq)
        for seq in [s for s in self.encoder.pending if s.pipeline is not None]:
            self._advance_pipeline(seq)
        for seq in ready:
            if seq.pipeline is not None:  # pipelined: every item is in; the rest of the prompt may go
                self._advance_pipeline(seq)
                seq.pipeline, seq.prefill_limit = None, None
                continue
            if not self.config.computes:  # encode-only: features stored, done
                seq.state = RequestState.HANDED_OFF
                self._emit(seq)
                continue
            try:
                seq.prompt_embeds = self.runner.build_prompt_embeds(seq.prompt_token_ids,
                                                                    [m.features[0] for m in seq.media])
            except ValueError as e:
                self.scheduler.fail(seq, f"media features do not fit the prompt: {e}")
                self._emit(seq)
                continue
            self.scheduler.add(seq)

    def _emit(self, seq: Sequence) -> None:
        self._outputs.append(make_output(seq))
        if seq.state.done:  # a KV_HELD request's id stays taken in the scheduler until its blocks go
            self._seqs.pop(seq.request_id, None)
            self._outputs += sequence_group.unforked_ends(seq)  # n > 1 ended before its first token

    def load_report(self) -> dict[str, int]:
        r, enc = self.scheduler.load(), self.encoder
        return {**r, "waiting": r["waiting"] + len(enc.pending), "queued_media": sum(len(s.media) for s in enc.pending),
                "encoder_runs": enc.encoder_runs, "recomputes": enc.recomputes,
                "prefix_queried_tokens": self.scheduler.prefix_queried_tokens,
                "prefix_hit_tokens": self.scheduler.prefix_hit_tokens}
