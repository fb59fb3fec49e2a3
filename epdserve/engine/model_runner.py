"""Model runner: turns a scheduled batch into one packed forward pass and sampled tokens.

Owns the device-side work of a step: building packed inputs (text embeddings, media features
spliced in, M-RoPE positions per request), attention metadata, the layer loop over
transformers' decoder layers with epdserve's paged attention, and the LM head on the rows that
sample. The KV connector's worker side runs inside the loop: `start_load_kv` before it,
`wait_for_layer_load(i)` before layer i, `save_kv_layer(i)` after it (the P→D transfer sends
layer i while layer i+1 computes), `wait_for_save` at the end. Block tables come with the batch;
the runner never sees the block manager. A step's attention metadata is built on the host and
uploaded once (ops/attention_meta.py); the step reads one thing back, the sampled tokens.
Qwen3-VL's DeepStack features of the visual tokens in a step's prompt chunks are added to the
hidden states after the first LM layers, as transformers does (`model.deepstack`).
"""
from __future__ import annotations

import time

import torch

from epdserve.engine.kv_cache import PagedKVCache
from epdserve.engine.sampler import sample
from epdserve.engine.scheduler import ScheduledSeq
from epdserve.model.adapter import VLMAdapter
from epdserve.model.deepstack import chunk_deepstack
from epdserve.ops import paged_attention
from epdserve.ops.attention_meta import RequestSpan, build_attention_meta
from epdserve.ops.backend import PagedOps
from epdserve.seams.kv_connector import KVConnector


class ModelRunner:
    def __init__(self, adapter: VLMAdapter, kv_cache: PagedKVCache, ops: PagedOps,
                 connector: KVConnector | None = None):
        self.adapter = adapter
        self.kv_cache = kv_cache
        self.ops = ops
        self.connector = connector
        self.device = adapter.device
        adapter.text_config._attn_implementation = paged_attention.register()

    @torch.inference_mode()
    def build_prompt_embeds(self, token_ids: list[int], features: list[torch.Tensor]) -> torch.Tensor:
        """Text embeddings of a prompt with each image's (and video's) features at its placeholder tokens."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        emb = self.adapter.embed_tokens(ids)
        if features:
            mask = ids == self.adapter.image_token_id
            if self.adapter.video_token_id is not None:
                mask |= ids == self.adapter.video_token_id
            feats = torch.cat([f.to(self.device, emb.dtype) for f in features])
            if int(mask.sum()) != feats.shape[0]:
                raise ValueError(f"{int(mask.sum())} image tokens but {feats.shape[0]} feature rows")
            emb[mask] = feats
        return emb

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[int | None]:
        """Run one step; returns the sampled token per item (None where the item only prefilled a chunk)."""
        t0 = time.perf_counter()
        hidden, position_ids, meta = self._inputs(batch)
        deepstack = self._deepstack(batch, hidden) if self.adapter.num_deepstack else None
        self.inputs_s = time.perf_counter() - t0  # host time of building this step's inputs (EngineStats)
        conn = self.connector
        cos_sin = self.adapter.rotary(hidden, position_ids)
        if conn is not None:
            conn.start_load_kv()
        for i, layer in enumerate(self.adapter.layers):
            if conn is not None:
                conn.wait_for_layer_load(i)
            hidden = layer(hidden, attention_mask=None, position_embeddings=cos_sin, epd_meta=meta)
            if deepstack is not None and i < len(deepstack[1]):
                rows = deepstack[0]
                hidden[0, rows] = hidden[0, rows] + deepstack[1][i]
            if conn is not None:
                conn.save_kv_layer(i)
        if conn is not None:
            conn.wait_for_save()
        return self._sample(batch, hidden)

    def _inputs(self, batch: list[ScheduledSeq]):
        bs = self.kv_cache.spec.block_size
        ids, pos, slots, spans = [], [], [], []
        embed_rows: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for item in batch:
            seq, s, e = item.seq, item.start, item.end
            ids.extend(seq.token_at(i) for i in range(s, e))
            pos.append(seq.position_slice(s, e))
            slots.extend(item.slots(bs))
            if seq.prompt_embeds is not None and s < seq.prompt_len:
                embed_rows.append((offset, seq.prompt_embeds[s : min(e, seq.prompt_len)]))
            spans.append(RequestSpan(offset, item.num_tokens, e, item.block_ids))
            offset += item.num_tokens
        dev = self.device
        hidden = self.adapter.embed_tokens(torch.tensor(ids, dtype=torch.long, device=dev))
        for off, rows in embed_rows:
            hidden[off : off + rows.shape[0]] = rows
        hidden = hidden.unsqueeze(0)
        position_ids = torch.cat(pos, dim=1).unsqueeze(1).to(dev)  # [3, 1, T]
        meta = build_attention_meta(spans, slots, self.kv_cache, self.ops, dev)
        return hidden, position_ids, meta

    def _deepstack(self, batch: list[ScheduledSeq], hidden: torch.Tensor):
        """(packed rows of the visual tokens in this step's prompt chunks, per deepstack layer their
        features), or None when the step has none."""
        rows: list[int] = []
        per_item: list[list[torch.Tensor]] = []
        offset, visual = 0, (self.adapter.image_token_id, self.adapter.video_token_id)
        for item in batch:
            seq = item.seq
            if seq.media and item.start < seq.prompt_len:
                found = chunk_deepstack(seq.prompt_token_ids, visual, [m.features for m in seq.media],
                                        item.start, item.end)
                if found is not None:
                    rows.extend(offset + r for r in found[0])
                    per_item.append(found[1])
            offset += item.num_tokens
        if not rows:
            return None
        dev, dtype = hidden.device, hidden.dtype
        layers = [torch.cat([f[i] for f in per_item]).to(dev, dtype) for i in range(len(per_item[0]))]
        return torch.tensor(rows, dtype=torch.long, device=dev), layers

    def _sample(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> list[int | None]:
        last_rows, sampling = [], []
        offset = 0
        for k, item in enumerate(batch):
            offset += item.num_tokens
            if item.samples:
                last_rows.append(offset - 1)
                sampling.append(k)
        result: list[int | None] = [None] * len(batch)
        if not sampling:
            return result
        h = self.adapter.norm(hidden[0, last_rows])
        logits = self.adapter.lm_head(h).float()
        toks = sample(logits, [batch[k].seq.params for k in sampling], [batch[k].seq.generator for k in sampling])
        for k, t in zip(sampling, toks):
            result[k] = t
        return result
