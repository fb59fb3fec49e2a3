"""Model runner: turns a `ScheduledStep` into one packed forward pass and a `StepResult`.

`execute(step)` (engine/step_contract.py) runs the step's block copies, then the forward, then
the sampler, and returns what it drew; it assigns nothing on the scheduler's objects (it reads
each row's request for its inputs). Owns the device-side work of a step: packing its inputs (token ids, M-RoPE positions, rows that
sample, the attention metadata) into one buffer uploaded with one copy (engine/step_buffers.py),
text embeddings with media features spliced in, the lean LM forward (engine/lm/), the LM head on
the rows that sample, and the sampler (engine/sampler.py `StepSampler`: bias, penalties, grammar
mask, tokens, a group's choices). The step reads one thing back: the sampled tokens. The KV
connector's worker side runs inside the forward: `start_load_kv` before it,
`wait_for_layer_load(i)` before layer i, `save_kv_layer(i)` after it (the P→D transfer sends
layer i while layer i+1 computes), `wait_for_save` at the end. Block tables come with the batch;
the runner never sees the block manager. Qwen3-VL's DeepStack features of the visual tokens in
a step's prompt chunks are added to the hidden states after the first LM layers, as transformers
does (a pipelined prompt's chunk never reaches an item whose features have not arrived: only the
items ahead of the first missing one are passed on). Decode-only steps replay a captured graph where the platform has graphs
(engine/graph_runner.py; checked against eager at start-up: engine/graph_check.py); `enforce_eager` turns that off.
"""
from __future__ import annotations

import itertools
import logging
import time
from array import array

import torch

from epdserve.engine.forward_inputs import ForwardInputs
from epdserve.engine.graph_check import graph_self_check
from epdserve.engine.graph_runner import DecodeGraphs
from epdserve.engine.kv_cache import PagedKVCache
from epdserve.engine.lm.forward import LeanLM
from epdserve.engine.sampler import StepSampler
from epdserve.engine.step_buffers import StepBuffers
from epdserve.engine.step_contract import ScheduledStep, StepResult, StepRow
from epdserve.model.adapter import VLMAdapter
from epdserve.model.deepstack import chunk_deepstack
from epdserve.ops.attention_meta import RequestSpan, StepPacker, plan_attention_meta
from epdserve.ops.backend import PagedOps
from epdserve.ops.layer_ops import LayerOps
from epdserve.seams.kv_connector import KVConnector

log = logging.getLogger(__name__)


def _layerwise(connector: KVConnector | None) -> bool:
    """Whether the connector does work inside the forward (P's layerwise sends or loads)."""
    if connector is None:
        return False
    cls = type(connector)
    return any(getattr(cls, name) is not getattr(KVConnector, name)
               for name in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"))


class ModelRunner:
    def __init__(self, adapter: VLMAdapter, lm: LeanLM, kv_cache: PagedKVCache, ops: PagedOps,
                 layer_ops: LayerOps, platform, connector: KVConnector | None = None,
                 max_batch: int = 128, max_model_len: int = 4096, enforce_eager: bool = False, decodes: bool = True):
        self.adapter = adapter
        self.lm = lm
        self.kv_cache = kv_cache
        self.ops = ops
        self.layer_ops = layer_ops
        self.connector = connector
        self.device = adapter.device
        self.buffers = StepBuffers(self.device, platform)
        layer_ops.rotary_range(lm.rotary.scaling)  # |cos|, |sin| <= the rope's attention scaling (1 for most)
        layer_ops.check(lm.layer_shapes(), self.device)  # kernels that cannot run here refuse the start
        self.graphs: DecodeGraphs | None = None
        self.sampler = StepSampler(max_batch)
        self.tp = None  # rank 0 of a tensor-parallel group: its engine/tp/group.py TPGroup
        self._inputs_at = 0.0  # when the last forward's inputs were ready (EngineStats' inputs_s)
        self._copies: tuple = ()  # the step's block copies, for the other ranks
        moe = any(w.moe is not None for w in lm.layers)
        # graph evidence (`graph_report`): why graphs are off, replays, eager decode steps by reason
        # NPU: a torch_npu without the graph-task API, or without FIA's .out / max-workspace calls
        no_graphs = platform.graphs_unavailable_reason() or ops.graphs_unavailable_reason()
        off = ((no_graphs is not None, no_graphs),
               (not decodes, "this engine never decodes (E or P): no graphs, no logits buffers"),
               (enforce_eager, "--enforce-eager (or tensor parallelism)"),
               (moe, "Qwen3-VL-MoE's expert routing reads the device"),
               (_layerwise(connector), "P's layerwise KV sends run between layers"))
        self.graphs_off_why = next((why for cond, why in off if cond), "")
        self.graph_replays = 0
        self.eager_decode_steps: dict[str, int] = {}  # reason -> decode-only steps run eagerly
        if not self.graphs_off_why:
            bs = kv_cache.spec.block_size
            self.graphs = DecodeGraphs(lm, kv_cache, ops, layer_ops, platform, self.buffers, max_batch,
                                       -(-max_model_len // bs))

    def capture_graphs(self, context_tokens: int = 256) -> float:
        """Capture the decode graphs of every batch bucket for contexts up to `context_tokens`,
        then replay one step against eager (engine/graph_check.py); seconds taken (0 where graphs
        are off). A capture that fails, or a replay that differs, turns graphs off for this
        engine, loudly: every step then runs eagerly, as with --enforce-eager."""
        if self.graphs is None:
            return 0.0
        try:
            took = self.graphs.capture_startup(-(-context_tokens // self.kv_cache.spec.block_size))
            differs = graph_self_check(self)
        except Exception as e:  # a driver or kernel that cannot be captured: eager still serves
            self._graphs_off(e)
            return 0.0
        if differs:
            log.warning("decode graphs off: %s; this engine runs every step eagerly", differs)
            self.graphs_off_why, self.graphs = differs, None
            return 0.0
        return took

    def _graphs_off(self, error: Exception) -> None:
        log.warning("decode graph capture failed (%s: %s); this engine runs every step eagerly "
                    "(as with --enforce-eager)", type(error).__name__, error, exc_info=error)
        self.graphs_off_why = f"capture failed: {type(error).__name__}: {error}"
        self.graphs = None

    def graph_report(self) -> dict:
        """The decode graphs' evidence: on or off and why, keys captured and the seconds it took,
        replays, and the decode-only steps that ran eagerly, by reason."""
        g = self.graphs
        return {"graphs": g is not None, "why_off": "" if g is not None else self.graphs_off_why,
                "keys": len(g.graphs) if g else 0,
                "capture_s": g.capture_s if g else 0.0, "replays": self.graph_replays,
                "eager_decode_steps": dict(self.eager_decode_steps)}

    def _eager(self, why: str) -> None:
        self.eager_decode_steps[why] = self.eager_decode_steps.get(why, 0) + 1

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
    def execute(self, step: ScheduledStep) -> StepResult:
        """Run one step: its block copies, its forward, its sampling."""
        t0 = time.perf_counter()
        self.kv_cache.copy_blocks(list(step.block_copies))
        self._copies = step.block_copies  # the other ranks copy them before this step's forward too
        if not step.rows:
            if self.tp is not None and step.block_copies:
                self.tp.send(None, step.block_copies)
            return StepResult((), (), ())
        if step.decode_only:
            return self._decode(step.rows, t0)
        return self._mixed(step, t0)

    # ------------------------------------------------------------------ decode-only steps
    def _decode(self, batch: tuple[StepRow, ...], t0: float) -> StepResult:
        bs = self.kv_cache.spec.block_size
        ids, slots, ctx, tables = array("q"), array("q"), array("q"), []
        pos = array("q")
        for item in batch:
            seq, i = item.seq, item.start
            t = item.block_ids
            ids.append(seq.output_token_ids[i - seq.prompt_len])
            pos.append(i + seq.rope_delta)
            slots.append(t[i // bs] * bs + i % bs)
            ctx.append(i + 1)
            tables.append(t)
        key = self.graphs.key(batch) if self.graphs is not None else None
        if key is not None:
            self._ensure_positions(max(pos) + 1)
            inputs_s = time.perf_counter() - t0
            try:
                logits = self.graphs.run(key, ids, (pos, pos, pos), slots, ctx, tables)
            except Exception as e:  # a new bucket that failed to capture: eager from now on
                self._graphs_off(e)
            else:
                self.graph_replays += 1
                return self._sample(batch, logits, inputs_s)
        self._eager(self.graphs_off_why if self.graphs is None
                    else "no bucket: a batch or width past the captured ones, and no room for another graph")
        spans = tuple(RequestSpan(k, 1, c, t) for k, (c, t) in enumerate(zip(ctx, tables)))
        normed = self.forward(ForwardInputs(ids, pos * 3, spans, slots, max(pos)))
        return self._sample(batch, self.lm.logits(normed).float(), self._inputs_at - t0)

    # ------------------------------------------------------------------ steps with prompt chunks
    def _mixed(self, step: ScheduledStep, t0: float) -> StepResult:
        batch, bs = step.rows, self.kv_cache.spec.block_size
        ids, slots, spans, sample_rows = array("q"), array("q"), [], array("q")
        pos: list[list[int]] = [[], [], []]
        embed_rows: list[tuple[int, torch.Tensor]] = []
        offset, top = 0, 0
        for item in batch:
            seq, s, e = item.seq, item.start, item.end
            ids.extend(seq.token_at(i) for i in range(s, e))
            p3 = seq.position_slice(s, e).tolist()
            for r in range(3):
                pos[r].extend(p3[r])
            top = max(top, max(max(r) for r in p3))
            slots.extend(item.slots(bs))
            if seq.prompt_embeds is not None and s < seq.prompt_len:
                embed_rows.append((offset, seq.prompt_embeds[s : min(e, seq.prompt_len)]))
            spans.append(RequestSpan(offset, item.num_tokens, e, item.block_ids))
            offset += item.num_tokens
            if item.samples:
                sample_rows.append(offset - 1)
        deepstack = self._deepstack(batch) if self.adapter.num_deepstack else None
        normed = self.forward(ForwardInputs(ids, array("q", pos[0] + pos[1] + pos[2]), tuple(spans), slots, top,
                                             sample_rows, tuple(embed_rows), deepstack))
        inputs_s = self._inputs_at - t0  # host time of building this step's inputs (EngineStats)
        if normed is None:
            return StepResult((None,) * len(batch), (None,) * len(batch), (None,) * len(batch), inputs_s)
        return self._sample(step.sampling, self.lm.logits(normed).float(), inputs_s, batch)

    # ------------------------------------------------------------------ the forward (every rank)
    def forward(self, f: ForwardInputs) -> torch.Tensor | None:
        """The LM over one step's packed tokens: the normed hidden states of the rows whose logits
        are wanted (`f.sample_rows`; every row when None), None when no row is. Under tensor
        parallelism rank 0 sends `f` to the other ranks first, which run this same call
        (engine/tp_rank.py)."""
        if self.tp is not None:
            self.tp.send(f, self._copies)
        self._ensure_positions(f.top_position + 1)
        T = len(f.ids)
        p = StepPacker()
        i_ids = p.add(f.ids, torch.int64)
        i_pos = p.add(f.positions, torch.int64, (3, T))
        i_rows = p.add(f.sample_rows, torch.int64) if f.sample_rows is not None else None
        build = plan_attention_meta(p, list(f.spans), f.slots, self.kv_cache, self.ops)
        up = self.buffers.upload(p)
        meta = build(up)
        hidden = self.lm.embed(up[i_ids])
        for off, rows in f.embed_rows:
            hidden[off : off + rows.shape[0]] = rows.to(hidden.device, hidden.dtype)
        deepstack = None
        if f.deepstack is not None:
            rows, layers = f.deepstack
            deepstack = (torch.tensor(rows, dtype=torch.long, device=hidden.device),
                         [t.to(hidden.device, hidden.dtype) for t in layers])
        self._inputs_at = time.perf_counter()
        normed = self.lm.forward(hidden, up[i_pos], meta, self.layer_ops, self.connector, deepstack)
        if i_rows is None:
            return normed
        return normed.index_select(0, up[i_rows]) if f.sample_rows else None

    def _ensure_positions(self, length: int) -> None:
        if self.lm.rotary.ensure(length) and self.graphs is not None:
            self.graphs.reset()  # the graphs read the tables that were replaced

    def _deepstack(self, batch: tuple[StepRow, ...]):
        """(packed rows of the visual tokens in this step's prompt chunks, per deepstack layer their
        features, where the features are), or None when the step has none."""
        rows: list[int] = []
        per_item: list[list[torch.Tensor]] = []
        offset, visual = 0, (self.adapter.image_token_id, self.adapter.video_token_id)
        for item in batch:
            seq = item.seq
            if seq.media and item.start < seq.prompt_len:
                arrived = list(itertools.takewhile(lambda f: f is not None, (m.features for m in seq.media)))
                found = chunk_deepstack(seq.prompt_token_ids, visual, arrived, item.start, item.end)
                if found is not None:
                    rows.extend(offset + r for r in found[0])
                    per_item.append(found[1])
            offset += item.num_tokens
        if not rows:
            return None
        return tuple(rows), [torch.cat([f[i] for f in per_item]) for i in range(len(per_item[0]))]

    def _sample(self, sampling, logits: torch.Tensor, inputs_s: float, rows=None) -> StepResult:
        """The step's result from the logits of its `sampling` rows (in sample-row order) among
        `rows` (every row of the step; default: `sampling`, a step where every row samples)."""
        toks, logprobs, choices = self.sampler(logits, [r.seq for r in sampling])
        if rows is None or len(rows) == len(sampling):
            return StepResult(tuple(toks), tuple(logprobs), tuple(choices), inputs_s)
        per_row: list = [(None, None, None)] * len(rows)
        for k, r in enumerate(rows):
            if r.sample_row is not None:
                per_row[k] = (toks[r.sample_row], logprobs[r.sample_row], choices[r.sample_row])
        t, lp, ch = zip(*per_row)
        return StepResult(t, lp, ch, inputs_s)
