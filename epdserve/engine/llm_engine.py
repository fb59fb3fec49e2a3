"""LLMEngine: one engine's step loop — encode → schedule → execute → update.

Request lifecycle (whole pipeline, roles "EPD"): `add_request` preprocesses media and queues
the request at ENCODING (or WAITING if text-only); each `step` encodes pending media (skipping
media whose features the `FeatureProvider` already holds), admits ready requests, runs one
packed forward, samples, checks stops and returns `RequestOutput`s. Blocks return to the free
list the moment a request finishes or is aborted.

Roles: an engine may run any subset of E, P, D (see `EngineConfig.roles`):
- encode-only: `add_encode_request` encodes media into the provider and reports done;
- prefill-only: a request stops after its first token and parks at KV_HELD, its blocks intact
  for export, until `release(request_id)`;
- decode-only: `add_prefilled_request` reserves blocks for imported KV (WAITING_KV) and
  `kv_ready` admits the request to the decode batch.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from epdserve.engine.block_manager import BlockManager
from epdserve.engine.config import EngineConfig
from epdserve.engine.encode_stage import EncodeStage
from epdserve.transfer.feature_provider import FeatureProvider, LocalFeatureProvider
from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.engine.model_runner import ModelRunner
from epdserve.engine.outputs import RequestOutput
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.scheduler import Scheduler
from epdserve.engine.sequence import MediaItem, Sequence, SeqStatus
from epdserve.engine.stats import EngineStats
from epdserve.engine.stop_checker import StopChecker
from epdserve.model.adapter import VLMAdapter
from epdserve.model.errors import InvalidRequestError
from epdserve.model.loader import eos_token_ids, load_checkpoint
from epdserve.model.processor import MediaInput, MultimodalProcessor
from epdserve.platform import get_platform
from epdserve.transfer.mm_store.keys import media_key, namespace_for

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLMEngine:
    def __init__(self, config: EngineConfig, features: FeatureProvider | None = None):
        self.config = config
        self.platform = get_platform(config.device)
        self.device = self.platform.device()
        dtype = _DTYPES.get(config.dtype) or (torch.float32 if self.platform.name == "cpu" else torch.bfloat16)
        ckpt = load_checkpoint(config.model, self.device, dtype)
        self.checkpoint = ckpt
        self.tokenizer = ckpt.tokenizer
        self.adapter = VLMAdapter(ckpt.model)
        a = self.adapter
        self.max_model_len = config.max_model_len or min(a.max_position_embeddings, 32768)
        self.processor = MultimodalProcessor(
            ckpt.tokenizer, ckpt.image_processor, a.image_token_id, a.merge_size, self.max_model_len,
            a.text_config.vocab_size,
        )
        self.namespace = namespace_for(str(config.model), a.vision_tower, ckpt.image_processor.to_dict())
        spec = KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, config.block_size, dtype)
        num_blocks = spec.blocks_for_budget(config.kv_cache_memory_bytes)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.kv_cache = PagedKVCache(spec, num_blocks, self.device)
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self.runner = ModelRunner(a, self.kv_cache, self.blocks)
        self.features = features or LocalFeatureProvider()
        self.stop_checker = StopChecker(
            ckpt.tokenizer,
            eos_token_ids(getattr(getattr(ckpt.model, "generation_config", None), "eos_token_id", None), ckpt.tokenizer),
            self.max_model_len,
        )
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self.encoder = EncodeStage(
            a, self.features, encodes=config.encodes, prefills=config.prefills, wait_s=config.feature_wait_s,
            max_images_per_step=config.max_encode_images_per_step, stats=self.stats,
        )
        self._ready_outputs: list[RequestOutput] = []
        self._arrivals = itertools.count()

    # ---------------------------------------------------------------- requests in
    def add_request(self, request_id: str, prompt: str | list[int], images: list | None = None,
                    params: SamplingParams | None = None) -> None:
        """Queue a request; bad input fails this request only (its output carries the error)."""
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        try:
            processed = self.processor.process(prompt, images)
        except InvalidRequestError as e:
            self._fail_early(request_id, str(e))
            return
        self.add_processed(request_id, processed.token_ids, [self.media_item(m) for m in processed.media], params)

    def media_item(self, m: MediaInput, key: str | None = None) -> MediaItem:
        """A request's media item from preprocessed media (key computed unless given)."""
        key = key or media_key(m.raw, self.namespace)
        return MediaItem(key=key, input=m, num_tokens=m.num_tokens, grid_thw=m.grid_thw)

    def add_processed(self, request_id: str, token_ids: list[int], media: list[MediaItem],
                      params: SamplingParams, feature_target: str | None = None) -> None:
        """Queue a request whose placeholders are already expanded (the scheduler did it).

        A media item may come without raw media (`input=None`) when its features are known to be
        in the store; the request then fails if they are gone (nothing to recompute from).
        """
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        n_img = sum(1 for t in token_ids if t == self.adapter.image_token_id)
        if n_img != sum(m.num_tokens for m in media):
            self._fail_early(request_id, f"{n_img} image tokens in the prompt but media for {sum(m.num_tokens for m in media)}")
            return
        if self.config.prefills and len(token_ids) >= self.max_model_len:
            self._fail_early(request_id, f"prompt is {len(token_ids)} tokens; the model's context is {self.max_model_len}")
            return
        seq = Sequence(request_id, list(token_ids), params, media=media, arrival=next(self._arrivals))
        seq.feature_target = feature_target
        seq.timings["arrival"] = time.time()
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if self.config.prefills:
            seq.positions, seq.rope_delta = self.adapter.rope_index(seq.prompt_token_ids, [m.grid_thw for m in media])
        self._seqs[request_id] = seq
        if media:
            seq.status = SeqStatus.ENCODING
            self.encoder.add(seq)
        elif not self.config.prefills:
            seq.finish_reason = "encoded"
            self._finish(seq)
        else:
            self.scheduler.add(seq)

    def add_encode_request(self, request_id: str, media: list[MediaItem], feature_target: str | None = None) -> None:
        """Encode-only role: store the features of `media`, telling `feature_target` (a prefill side)."""
        if not self.config.encodes:
            raise ValueError("this engine does not run the encode stage")
        n = sum(m.num_tokens for m in media)
        self.add_processed(request_id, [self.adapter.image_token_id] * n, media, SamplingParams(max_tokens=1),
                           feature_target)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], rope_delta: int,
                              first_token: int, params: SamplingParams, num_vision_tokens: int = 0) -> list[int]:
        """Decode-only role: reserve blocks for a request whose prompt KV will be imported.

        Returns the block table the KV must be written into (prompt tokens only). Blocks for the
        whole request (prompt + max_tokens) are reserved up front, so an imported request is
        never preempted (it could not be recomputed here without its media).
        """
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        total = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if not self.blocks.can_grow(request_id, total):
            raise MemoryError(f"not enough free KV blocks for {total} tokens")
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival=next(self._arrivals))
        seq.rope_delta = rope_delta
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.output_token_ids = [first_token]
        seq.emitted_tokens = 1
        seq.status = SeqStatus.WAITING_KV
        seq.timings["arrival"] = time.time()
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed + 1)
        self.blocks.grow(request_id, total)
        self._seqs[request_id] = seq
        self.stop_checker.update(seq)
        seq.emitted_text_len = len(seq.text)
        return self.blocks.table(request_id)[: self.blocks.blocks_needed(len(prompt_token_ids))]

    def kv_ready(self, request_id: str) -> None:
        """Decode-only role: the imported KV is in place; the request joins the decode batch."""
        seq = self._seqs[request_id]
        if seq.status is not SeqStatus.WAITING_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV ({seq.status.value})")
        if seq.finish_reason is not None:  # the first token already ended it
            self._finish(seq)
            return
        self.scheduler.add_running(seq)

    def kv_failed(self, request_id: str, message: str) -> None:
        """Decode-only role: the KV import failed; free the reserved blocks and report an error."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._fail(seq, message)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        self.encoder.remove(seq)
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        self._finish(seq)

    def release(self, request_id: str) -> None:
        """Prefill-only role: the request's KV has been exported; free its blocks."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.blocks.free(request_id)

    # ---------------------------------------------------------------- the loop
    def has_unfinished(self) -> bool:
        return bool(self.encoder.pending or self.scheduler.has_work() or self._ready_outputs)

    def step(self) -> list[RequestOutput]:
        outputs, self._ready_outputs = self._ready_outputs, []
        if self.encoder.pending:
            self._encode_step()
        batch = self.scheduler.schedule()
        if batch:
            t0 = time.perf_counter()
            tokens = self.runner.execute(batch)
            self.stats.record_step(batch, time.perf_counter() - t0)
            now = time.time()
            for item, tok in zip(batch, tokens):
                item.seq.num_computed_tokens = item.end
                if tok is None:
                    continue
                seq = item.seq
                seq.output_token_ids.append(tok)
                if len(seq.output_token_ids) == 1:
                    seq.timings.setdefault("first_token", now)
                self.stop_checker.update(seq)
                if seq.finish_reason is None and not self.config.decodes:
                    seq.finish_reason = "prefill_done"
                outputs.append(self._output(seq))
                if seq.finish_reason is not None:
                    self._finish(seq, emit=False)
        outputs.extend(self._ready_outputs)
        self._ready_outputs = []
        return outputs

    # ---------------------------------------------------------------- encode stage
    def _encode_step(self) -> None:
        ready, failed = self.encoder.step()
        for seq, message in failed:
            self._fail(seq, message)
        for seq in ready:
            if not self.config.prefills:  # encode-only role: the features are stored, done
                seq.finish_reason = "encoded"
                self._finish(seq)
                continue
            try:
                seq.prompt_embeds = self.runner.build_prompt_embeds(
                    seq.prompt_token_ids, [m.features[0] for m in seq.media]
                )
            except ValueError as e:
                self._fail(seq, f"media features do not fit the prompt: {e}")
                continue
            self.scheduler.add(seq)

    # ---------------------------------------------------------------- finishing
    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.emitted_tokens :]
        seq.emitted_tokens = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            new_text=self.stop_checker.text_delta(seq),
            token_ids=list(seq.output_token_ids),
            text=seq.text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            error=seq.error,
            num_prompt_tokens=seq.prompt_len,
            num_vision_tokens=seq.num_vision_tokens,
            num_cached_vision_tokens=sum(m.num_tokens for m in seq.media if m.from_store),
            rope_delta=seq.rope_delta,
            timings=dict(seq.timings),
        )

    def _finish(self, seq: Sequence, emit: bool = True) -> None:
        self.scheduler.remove(seq)
        if seq.finish_reason == "prefill_done":
            seq.status = SeqStatus.KV_HELD  # blocks stay until release()
        else:
            seq.status = SeqStatus.FINISHED
            self.blocks.free(seq.request_id)
            self._seqs.pop(seq.request_id, None)
        if emit:
            self._ready_outputs.append(self._output(seq))

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.error, seq.finish_reason = message, "error"
        self._finish(seq)

    def _fail_early(self, request_id: str, message: str) -> None:
        self._ready_outputs.append(
            RequestOutput(request_id, [], "", [], "", True, finish_reason="error", error=message)
        )

    def load_report(self) -> dict[str, int]:
        return {
            "free_kv_blocks": self.blocks.num_free,
            "total_kv_blocks": self.blocks.num_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self.encoder.pending),
            "queued_tokens": sum(s.num_tokens - s.num_computed_tokens for s in self.scheduler.waiting),
            "encoder_runs": self.encoder.encoder_runs,
            "recomputes": self.encoder.recomputes,
        }
