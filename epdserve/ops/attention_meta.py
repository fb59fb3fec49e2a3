"""Per-step attention metadata of a packed, variable-length batch over a paged KV cache.

Contract: the engine lays out a step's host-side lists (one `RequestSpan` per request, the flat
slots) with `plan_attention_meta` into a `StepPacker` (every integer the step uploads, in one
byte buffer), uploads that buffer with ONE host→device copy (engine/step_buffers.py), and then
calls the returned builder with the uploaded views: the tensors in `AttentionMeta` are views of
that upload, so no layer casts or uploads anything. Host copies stay alongside
(`decode_ctx_lens_host`, `VarlenBatch.q_ends` / `kv_lens`) for operator arguments that are host
ints (torch_npu's `SymInt[]` actual_seq_lengths*), so no layer reads a device tensor back.

Ops with `attends_varlen` (the NPU's) get one `VarlenBatch` covering every request of the step
and attend it in one call; the others get the decode / prefill split. The metadata is handed to
every layer's attention call as an argument (never stored on a module), so concurrent engines
never share it.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from epdserve.ops.backend import PagedOps

_TYPECODES = {torch.int64: "q", torch.int32: "i"}
_ALIGN = 8  # bytes: every part starts where an int64 view of it is legal


@dataclass(frozen=True)
class RequestSpan:
    """One request's part of a step, on the host."""

    q_start: int  # offset of its tokens in the packed batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in the cache after this step (start + q_len)
    block_ids: Sequence[int]  # its block table

    @property
    def is_decode(self) -> bool:
        return self.q_len == 1 and self.ctx_len > 1


@dataclass(frozen=True)
class PrefillSegment:
    q_start: int  # offset of this request's tokens in the packed batch
    q_len: int
    ctx_len: int  # tokens in the cache for this request after this step (start + q_len)
    block_table: torch.Tensor  # [n_blocks], on the device


@dataclass(frozen=True)
class VarlenBatch:
    """Every request of a step, for operators that attend a whole packed batch in one call."""

    block_tables: torch.Tensor  # [R, max_blocks] on the device, padded with block 0
    q_ends: tuple[int, ...]  # cumulative query lengths (host): request r's rows end at q_ends[r]
    kv_lens: tuple[int, ...]  # per request, cached tokens after this step (host)
    # set only while a decode graph is captured: the recorder of the calls that read these host
    # lengths, re-issued with each step's before a replay (PagedOps.graph_tasks)
    graph_tasks: object | None = None


@dataclass
class AttentionMeta:
    kv_cache: object  # engine.kv_cache.PagedKVCache
    ops: PagedOps  # the paged operators this engine uses (ops/select.py)
    slots: torch.Tensor  # [T] flat slot of every packed token
    prefills: list[PrefillSegment]
    decode_token_idx: torch.Tensor  # [B] packed index of each decode token
    decode_block_tables: torch.Tensor  # [B, max_blocks] (padded)
    decode_ctx_lens: torch.Tensor  # [B] on the device
    decode_ctx_lens_host: tuple[int, ...] = ()  # the same lengths on the host
    varlen: VarlenBatch | None = None  # set for ops with `attends_varlen`: the only field they read
    decode_only: bool = False  # every packed token is a decode token, in order (no scatter needed)


class StepPacker:
    """Host integer parts laid end to end in one byte buffer, each 8-byte aligned; after the
    upload, `views(device_bytes)` slices each part back out with its dtype and shape."""

    def __init__(self):
        self.buf = bytearray()
        self.parts: list[tuple[int, torch.dtype, tuple[int, ...]]] = []  # (byte offset, dtype, shape)

    def add(self, values: Sequence[int] | array, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> int:
        arr = values if isinstance(values, array) and values.typecode == _TYPECODES[dtype] \
            else array(_TYPECODES[dtype], values.tolist() if isinstance(values, array) else values)
        self.buf.extend(bytes(-len(self.buf) % _ALIGN))
        self.parts.append((len(self.buf), dtype, shape if shape is not None else (len(arr),)))
        self.buf.extend(arr.tobytes())
        return len(self.parts) - 1

    def add_table(self, tables: list[Sequence[int]], dtype: torch.dtype, pad: int = 0,
                  width: int | None = None) -> int:
        """Rows padded with block `pad` to `width` (default the widest; at least 1 column: the
        kernels reject width 0)."""
        width = width or max(map(len, tables), default=1) or 1
        code = _TYPECODES[dtype]
        flat, fill = array(code), array(code, [pad]) * width
        for t in tables:
            flat.extend(t if isinstance(t, array) and t.typecode == code else array(code, t))
            flat.extend(fill[: width - len(t)])
        return self.add(flat, dtype, (len(tables), width))

    @property
    def nbytes(self) -> int:
        return len(self.buf)

    def views(self, data: torch.Tensor) -> list[torch.Tensor]:
        """The parts as tensors over `data` (uint8, the uploaded copy of `buf`)."""
        out = []
        for off, dtype, shape in self.parts:
            n = _numel(shape) * _ITEM[dtype]
            out.append(data[off : off + n].view(dtype).view(shape))
        return out


_ITEM = {torch.int64: 8, torch.int32: 4}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_attention_meta(p: StepPacker, spans: list[RequestSpan], slots: Sequence[int], kv_cache,
                        ops: PagedOps) -> Callable[[list[torch.Tensor]], AttentionMeta]:
    """Add the step's attention indices to `p`; returns the builder of `AttentionMeta` from the
    uploaded views (see the module docstring)."""
    idt = ops.index_dtype
    i_slots = p.add(slots, idt)
    if ops.attends_varlen:
        i_tables = p.add_table([s.block_ids for s in spans], idt)
        q_ends, end = [], 0
        for s in spans:
            end += s.q_len
            q_ends.append(end)
        kv_lens = tuple(s.ctx_len for s in spans)

        def varlen(up: list[torch.Tensor]) -> AttentionMeta:
            empty = up[i_slots][:0]
            return AttentionMeta(kv_cache, ops, up[i_slots], [], empty, empty.view(0, 1), empty,
                                 varlen=VarlenBatch(up[i_tables], tuple(q_ends), kv_lens))
        return varlen
    dec = [s for s in spans if s.is_decode]
    pre = [s for s in spans if not s.is_decode]
    decode_only = bool(dec) and not pre
    i_idx = p.add([] if decode_only else [s.q_start for s in dec], torch.int64)
    ctx_host = tuple(s.ctx_len for s in dec)
    i_ctx = p.add(ctx_host, idt)
    i_dec = p.add_table([s.block_ids for s in dec], idt)
    i_pre = [p.add(s.block_ids, idt) for s in pre]

    def split(up: list[torch.Tensor]) -> AttentionMeta:
        prefills = [PrefillSegment(s.q_start, s.q_len, s.ctx_len, up[i]) for s, i in zip(pre, i_pre)]
        return AttentionMeta(kv_cache, ops, up[i_slots], prefills, up[i_idx], up[i_dec], up[i_ctx],
                             decode_ctx_lens_host=ctx_host, decode_only=decode_only)
    return split
