"""Per-step attention metadata of a packed, variable-length batch over a paged KV cache.

Contract: `build_attention_meta` is called once per step with the step's host-side lists (one
`RequestSpan` per request, the flat slots); it packs every index the layers read (slots, block
tables, decode rows and context lengths) into one host buffer of the engine's
`PagedOps.index_dtype` and uploads it with ONE host→device copy; the tensors in `AttentionMeta`
are views of that upload, so no layer casts or uploads anything. The host lists stay alongside
(`decode_ctx_lens_host`, `VarlenBatch.q_ends` / `kv_lens`) for operator arguments that are host
ints (torch_npu's `SymInt[]` actual_seq_lengths*), so no layer reads a device tensor back.

Ops with `attends_varlen` (the NPU's) get one `VarlenBatch` covering every request of the step
and attend it in one call; the others get the decode / prefill split. The metadata is handed to
every layer's attention call as a keyword argument (never stored on a module), so concurrent
engines never share it.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import torch

from epdserve.ops.backend import PagedOps

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


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


@dataclass
class AttentionMeta:
    kv_cache: object  # engine.kv_cache.PagedKVCache
    ops: PagedOps  # the paged operators this engine uses (ops/select.py)
    slots: torch.Tensor  # [T] flat slot of every packed token
    prefills: list[PrefillSegment]
    decode_token_idx: torch.Tensor  # [B] packed index of each decode token
    decode_block_tables: torch.Tensor  # [B, max_blocks] (padded with 0)
    decode_ctx_lens: torch.Tensor  # [B] on the device
    decode_ctx_lens_host: tuple[int, ...] = ()  # the same lengths on the host
    varlen: VarlenBatch | None = None  # set for ops with `attends_varlen`: the only field they read
    decode_only: bool = False  # every packed token is a decode token, in order (no scatter needed)

    def __post_init__(self):
        n = self.decode_token_idx.numel()
        self.decode_only = bool(n) and not self.prefills and n == self.slots.numel()


class _Packer:
    """Host int arrays laid end to end in one buffer; `views` slices the uploaded copy."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.buf = array(_TYPECODES[dtype])
        self.parts: list[tuple[int, tuple[int, ...]]] = []  # (offset, shape) per part

    def add(self, values: Sequence[int], shape: tuple[int, ...] | None = None) -> int:
        self.parts.append((len(self.buf), shape if shape is not None else (len(values),)))
        _extend(self.buf, values)
        return len(self.parts) - 1

    def add_table(self, tables: list[Sequence[int]]) -> int:
        """Rows padded with block 0 to the widest (at least 1 column: the kernels reject width 0)."""
        width = max(map(len, tables), default=1) or 1
        flat, pad = array(self.buf.typecode), array(self.buf.typecode, [0]) * width
        for t in tables:  # padded rows are memcpys
            _extend(flat, t)
            flat.extend(pad[: width - len(t)])
        return self.add(flat, (len(tables), width))

    def upload(self, device) -> list[torch.Tensor]:
        host = torch.frombuffer(self.buf, dtype=self.dtype) if self.buf else torch.empty(0, dtype=self.dtype)
        dev = host.to(device)  # the step's one host→device copy of its indices
        return [dev[o : o + _numel(s)].view(s) for o, s in self.parts]


def _extend(buf: array, values: Sequence[int]) -> None:
    """`buf.extend`, which takes an array only of its own kind (block tables come as int64 arrays)."""
    buf.extend(values.tolist() if isinstance(values, array) and values.typecode != buf.typecode else values)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_attention_meta(spans: list[RequestSpan], slots: Sequence[int], kv_cache, ops: PagedOps,
                         device) -> AttentionMeta:
    """The step's metadata from its host lists, uploaded in one copy (see the module docstring)."""
    p = _Packer(ops.index_dtype)
    i_slots = p.add(slots)
    if ops.attends_varlen:
        i_tables = p.add_table([s.block_ids for s in spans])
        up = p.upload(device)
        q_ends, end = [], 0
        for s in spans:
            end += s.q_len
            q_ends.append(end)
        varlen = VarlenBatch(up[i_tables], tuple(q_ends), tuple(s.ctx_len for s in spans))
        empty = up[i_slots][:0]
        return AttentionMeta(kv_cache, ops, up[i_slots], [], empty, empty.view(0, 1), empty,
                             varlen=varlen)
    dec = [s for s in spans if s.is_decode]
    pre = [s for s in spans if not s.is_decode]
    i_idx = p.add([s.q_start for s in dec])
    ctx_host = tuple(s.ctx_len for s in dec)
    i_ctx = p.add(ctx_host)
    i_dec = p.add_table([s.block_ids for s in dec])
    i_pre = [p.add(s.block_ids) for s in pre]
    up = p.upload(device)
    prefills = [PrefillSegment(s.q_start, s.q_len, s.ctx_len, up[i]) for s, i in zip(pre, i_pre)]
    return AttentionMeta(kv_cache, ops, up[i_slots], prefills, up[i_idx], up[i_dec], up[i_ctx],
                         decode_ctx_lens_host=ctx_host)
