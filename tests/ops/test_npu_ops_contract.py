"""Contract test of `NpuPagedOps` on CPU: a stand-in for torch_npu (injected only here) pins every
kernel call and computes what the real kernel computes, so the NPU path's outputs can be checked
against `PortableOps`.

The stand-in is the fake torch_npu (tests/fakes/torch_npu_fake.py) with the operator schemas of
one torch_npu line (tests/fixtures/torch_npu/<line>.txt, from the wheels the extras install);
every test taking `npu` runs once per line, so a keyword a line lacks fails as on the device. It
rejects what the sources say the kernels reject (fp32, int64 block tables, a non-128 block size
for multi-token queries, non-contiguous inputs, a wrong causal mask) and does the documented
math: npu_fused_infer_attention_score = softmax(scale * q k^T + mask) v over the blocks of a
block table, sparse_mode 3 = right-down causal, layout TND with cumulative query lengths;
npu_scatter_pa_kv_cache writes the ND layout with cache_mode "Norm" and the NZ layout of its
golden test under "PA_NZ" (the default on 2.12.0, the only mode on 2.8.0 / 2.9.0, which therefore
write through the ATB _npu_reshape_and_cache).
"""
from __future__ import annotations

import functools
import itertools
import math
import sys

import pytest
import torch

from epdserve.ops.attention_meta import VarlenBatch
from epdserve.ops.npu_ops import NpuPagedOps
from epdserve.ops.portable import PortableOps
from tests.fakes.npu_kernels_fake import LINES
from tests.fakes.torch_npu_fake import FakeTorchNpu

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 128  # GQA 3:1; a head_dim TND takes; the NPU block size
SCALE = 1 / math.sqrt(HEAD_DIM)


def _require(cond, msg):
    if not cond:
        raise RuntimeError(msg)  # what a failed tiling/parameter check surfaces as


@functools.cache
def _causal_2048() -> torch.Tensor:
    """The only sparse_mode 3 mask FIA takes: triu(ones(2048, 2048), 1) (built once: it is 4M elements)."""
    return torch.ones(2048, 2048).triu(1).bool()


def _fia(a):
    """npu_fused_infer_attention_score with a block table ("PageAttention"), layouts BSND and TND.

    TND (the FIA doc's actual_seq_lengths: "required when input_layout is TND; its element count
    is the batch size; each element is the sum of the lengths of this batch and all previous
    ones"): query [T, N, D], actual_seq_lengths cumulative, actual_seq_lengths_kv per request."""
    q, key, value, bt, layout = a["query"], a["key"], a["value"], a["block_table"], a["input_layout"]
    if layout not in ("BSND", "TND") or bt is None:
        raise NotImplementedError("stand-in covers only paged BSND and TND")
    _require(q.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == q.dtype, "dtype")
    _require(q.is_contiguous() and key.is_contiguous() and value.is_contiguous(), "non-contiguous input")
    N, D = q.shape[-2:]
    n2 = a["num_key_value_heads"] or a["num_heads"]
    _require(N == a["num_heads"] and N % n2 == 0 and N // n2 <= 64, "num_heads / num_key_value_heads")
    _require(D * q.element_size() % 16 == 0, "head_dim must be 16-byte aligned")
    q_lens = a["actual_seq_lengths"]
    if layout == "TND":  # prompt_flash_attention_tiling.cpp CheckInputShapeWhenLayoutIsTND
        _require(q.dtype == torch.bfloat16, "When layout is TND, inputDataType should be bf16")
        _require(D in (64, 128) or (D == 192 and N == n2), "When layout is TND, queryD, keyD and valueD must be "
                 "same equal 192/128/64 (192: G must be 1)")
        _require(q.dim() == 3, "TND query is [T, N, D]")
        _require(isinstance(q_lens, list) and q_lens and all(type(n) is int for n in q_lens), "TND needs actual_seq_lengths")
        _require(all(x <= y for x, y in zip([0] + q_lens, q_lens)) and q_lens[-1] == q.shape[0],
                 "TND actual_seq_lengths: cumulative, ending at T")
        B, starts = len(q_lens), [0] + q_lens[:-1]
        q_lens = [e - s for s, e in zip(starts, q_lens)]
        rows = [q[s:s + n] for s, n in zip(starts, q_lens)]
    else:
        B, S = q.shape[:2]
        q_lens = q_lens or [S]
        q_lens = q_lens * B if len(q_lens) == 1 else q_lens
        rows = [q[b, :q_lens[b]] for b in range(B)]
    bs = a["block_size"]
    _require(0 < bs <= 512 and (max(q_lens) == 1 or (bs >= 128 and bs % 128 == 0)), f"block_size {bs}")
    _require(bt.dtype == torch.int32 and bt.dim() == 2 and bt.numel() > 0 and bt.shape[0] == B, "block_table")
    _require(key.dim() == 3 and key.shape[1] == bs and key.shape[2] == n2 * D and value.shape == key.shape,
             "paged key/value must be [num_blocks, block_size, kv_heads * head_dim]")
    kv_lens = a["actual_seq_lengths_kv"]
    _require(isinstance(kv_lens, list) and all(type(n) is int for n in kv_lens) and len(kv_lens) in (1, B),
             "actual_seq_lengths_kv: a list of ints, required with a block table")
    kv_lens = kv_lens * B if len(kv_lens) == 1 else kv_lens
    blocks = [-(-n // bs) for n in kv_lens]
    _require(bt.shape[1] >= max(blocks) and key.shape[0] >= sum(blocks), "block_table / num_blocks too small")
    causal = False
    if layout == "TND" or max(q_lens) > 1:  # BSND with S == 1 takes the incremental branch: no sparse_mode
        _require(a["sparse_mode"] in (0, 3), "stand-in covers sparse_mode 0 and 3")
        if a["sparse_mode"] == 3:
            m = a["atten_mask"]
            _require(m is not None and m.dtype in (torch.bool, torch.int8, torch.uint8)
                     and m.shape[-2:] == (2048, 2048) and m.numel() == 2048 * 2048, "sparse_mode 3 mask shape")
            _require(torch.equal(m.reshape(2048, 2048).bool(), _causal_2048()),
                     "sparse_mode 3 mask must be triu(ones(2048, 2048), 1)")
            causal = True
        else:
            _require(a["atten_mask"] is None, "stand-in covers sparse_mode 0 without a mask only")
    outs = []
    for b in range(B):
        pos = torch.arange(kv_lens[b])
        idx = bt[b].long()[pos // bs], pos % bs
        k = key[idx].view(-1, n2, D).float().repeat_interleave(N // n2, dim=1)  # [kv, N, D]
        v = value[idx].view(-1, n2, D).float().repeat_interleave(N // n2, dim=1)
        ql = q_lens[b]
        s = torch.einsum("qnd,knd->nqk", rows[b].float(), k) * a["scale"]
        if causal:  # right-down causal: query i sees keys j <= kv_len - q_len + i
            s.masked_fill_(pos[None, :] > torch.arange(ql)[:, None] + kv_lens[b] - ql, float("-inf"))
        outs.append(torch.einsum("nqk,knd->qnd", s.softmax(-1), v).to(q.dtype))
    if layout == "TND":
        return torch.cat(outs), torch.zeros(1)
    out = torch.zeros_like(q)
    for b, o in enumerate(outs):
        out[b, :q_lens[b]] = o
    return out, torch.zeros(1)


@pytest.fixture(params=LINES)
def line(request) -> str:
    return request.param


@pytest.fixture
def fake(monkeypatch, line) -> FakeTorchNpu:
    # each line's schema with a CANN that takes TND + paged (8.5.0): whether the line's own CANN
    # takes it is tests/ops/test_npu_attention_check.py's business
    return FakeTorchNpu(line=line, kernels={"npu_fused_infer_attention_score": _fia}, cann="8.5.0").install(monkeypatch)


@pytest.fixture
def npu(fake) -> list:
    return fake.kernel_calls


def _caches(num_blocks, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _block_tables(ctx_lens, num_blocks, seed=0):
    """Each request gets blocks from a shuffled pool (out of order); rows padded with block 0."""
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    need = [-(-n // BLOCK) for n in ctx_lens]
    table = torch.zeros(len(ctx_lens), max(need), dtype=torch.long)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(pool[:n])
        pool = pool[n:]
    return table


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kv_write_each_line_offers_writes_our_layout(npu, line, dtype, caplog):
    kc, vc = _caches(6, dtype)
    key = torch.randn(HEAD_DIM, 7, KV_HEADS).to(dtype).permute(1, 2, 0)  # non-contiguous [7, kv_heads, D]
    value = torch.randn(7, KV_HEADS, HEAD_DIM).to(dtype)
    slots = torch.tensor([700, 3, 129, 128, 511, 0, 767])  # out of order, across blocks, int64
    ref_k, ref_v = kc.clone(), vc.clone()
    PortableOps().reshape_and_cache(key, value, ref_k, ref_v, slots)

    NpuPagedOps().reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    cache = (dtype, (6, BLOCK, KV_HEADS, HEAD_DIM), True)
    tensors = {"key": (dtype, (7, KV_HEADS, HEAD_DIM), True), "value": (dtype, (7, KV_HEADS, HEAD_DIM), True),
               "key_cache": cache, "value_cache": cache}
    if line == "2.12.0":  # op-plugin 26.1.0: npu_scatter_pa_kv_cache takes cache_mode (an Ascend C operator)
        assert npu == [("npu_scatter_pa_kv_cache", (), {
            **tensors, "slot_mapping": (torch.int32, (7,), True), "cache_mode": "Norm"})]
        assert "ignores stream core limits" not in caplog.text
    else:  # op-plugin 7.2.0 / 7.3.0: no cache_mode, so the ATB operator, said once
        assert npu == [("_npu_reshape_and_cache", (), {**tensors, "slot_indices": (torch.int32, (7,), True)})]
        assert "ignores stream core limits" in caplog.text


def test_scatter_without_cache_mode_writes_nz_which_does_not_fit_our_layout(npu, line):
    # Why cache_mode="Norm" is needed: 'PA_NZ' (the keyword's default on 2.12.0, hard-coded in
    # ScatterPaKvCacheNpuOpApi.cpp on 2.8.0 / 2.9.0) is the NZ layout, not our ND cache.
    scatter = sys.modules["torch_npu"].npu_scatter_pa_kv_cache
    mode = {a.name: a.default_value for a in scatter.default._schema.arguments}.get("cache_mode")
    assert mode == ("PA_NZ" if line == "2.12.0" else None)
    kc, vc = _caches(2, torch.bfloat16)
    key = torch.randn(3, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="NZ cache shape"):
        scatter(key, key, kc, vc, torch.tensor([0, 1, 2]))
    if line != "2.12.0":  # what issue 26 found: the keyword itself is refused, as torch's binding refuses it
        with pytest.raises(RuntimeError, match="Unknown keyword argument 'cache_mode'"):
            scatter(key, key, kc, vc, torch.tensor([0, 1, 2]), cache_mode="Norm")


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp16: refused (test_npu_attention_check.py)
def test_decode_pins_the_paged_call_and_matches_portable(npu, dtype):
    ctx_lens = torch.tensor([1, 128, 129, 300, 77])  # one token, a full block, odd lengths
    num_blocks = 12
    kc, vc = _caches(num_blocks, dtype)
    tables = _block_tables(ctx_lens.tolist(), num_blocks)
    query = torch.randn(HEAD_DIM, 5, HEADS).to(dtype).permute(1, 2, 0)  # [B, heads, D], non-contiguous
    expected = PortableOps().decode_attention(query, kc, vc, tables, ctx_lens, SCALE)

    out = NpuPagedOps().decode_attention(query, kc, vc, tables, ctx_lens, SCALE)
    assert out.shape == (5, HEADS, HEAD_DIM) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **_tol(dtype))
    paged = (dtype, (num_blocks, BLOCK, KV_HEADS * HEAD_DIM), True)
    assert npu == [("npu_fused_infer_attention_score", ((dtype, (5, HEADS, HEAD_DIM), True), paged, paged), {
        "atten_mask": (torch.int8, (2048, 2048), True), "sparse_mode": 3,
        "block_table": (torch.int32, (5, 3), True), "actual_seq_lengths": [1, 2, 3, 4, 5],
        "actual_seq_lengths_kv": [1, 128, 129, 300, 77], "num_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "scale": SCALE, "input_layout": "TND", "block_size": BLOCK})]


@pytest.mark.parametrize("ctx_len,q_len", [(300, 45), (257, 257), (129, 1), (1, 1)])
def test_prefill_chunk_pins_the_causal_paged_call_and_matches_portable(npu, ctx_len, q_len):
    dtype = torch.bfloat16
    num_blocks = 5
    kc, vc = _caches(num_blocks, dtype, seed=1)
    table = _block_tables([ctx_len], num_blocks, seed=1)[0]
    query = torch.randn(q_len, HEADS, HEAD_DIM).to(dtype)
    expected = PortableOps().prefill_attention(query, kc, vc, table, ctx_len, SCALE)

    out = NpuPagedOps().prefill_attention(query, kc, vc, table, ctx_len, SCALE)
    assert out.shape == (q_len, HEADS, HEAD_DIM)
    torch.testing.assert_close(out, expected, **_tol(dtype))
    paged = (dtype, (num_blocks, BLOCK, KV_HEADS * HEAD_DIM), True)
    assert npu == [("npu_fused_infer_attention_score", ((dtype, (q_len, HEADS, HEAD_DIM), True), paged, paged), {
        "atten_mask": (torch.int8, (2048, 2048), True), "sparse_mode": 3,
        "block_table": (torch.int32, (1, len(table)), True), "actual_seq_lengths": [q_len],
        "actual_seq_lengths_kv": [ctx_len], "num_heads": HEADS, "num_key_value_heads": KV_HEADS, "scale": SCALE,
        "input_layout": "TND", "block_size": BLOCK})]


def test_a_whole_step_is_one_call_with_cumulative_query_lengths(npu):
    """Decodes, a later prompt chunk and a fresh prompt of one step: one TND call, each request's
    rows equal to what PortableOps computes for it alone."""
    dtype, num_blocks = torch.bfloat16, 16
    kc, vc = _caches(num_blocks, dtype, seed=2)
    q_lens, kv_lens = [1, 45, 1, 130, 1], [300, 300, 5, 130, 129]  # decode, chunk, decode, fresh prompt, decode
    tables = _block_tables(kv_lens, num_blocks, seed=2)
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM).to(dtype)
    ends = list(itertools.accumulate(q_lens))
    batch = VarlenBatch(tables.to(torch.int32), tuple(ends), tuple(kv_lens))

    out = NpuPagedOps().varlen_attention(query, kc, vc, batch, SCALE)
    portable = PortableOps()
    for b, (end, n) in enumerate(zip(ends, q_lens)):
        rows = slice(end - n, end)
        want = portable.prefill_attention(query[rows], kc, vc, tables[b], kv_lens[b], SCALE)
        torch.testing.assert_close(out[rows], want, **_tol(dtype))
    assert [(c[0], c[2]["actual_seq_lengths"], c[2]["actual_seq_lengths_kv"], c[2]["input_layout"]) for c in npu] == [
        ("npu_fused_infer_attention_score", [1, 46, 47, 177, 178], kv_lens, "TND")]


def test_empty_batches_call_no_kernel(npu):
    kc, vc = _caches(2, torch.bfloat16)
    ops = NpuPagedOps()
    out = ops.decode_attention(torch.empty(0, HEADS, HEAD_DIM, dtype=torch.bfloat16), kc, vc,
                               torch.empty(0, 1, dtype=torch.long), torch.empty(0, dtype=torch.long), SCALE)
    ops.reshape_and_cache(*(torch.empty(0, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16),) * 2, kc, vc,
                          torch.empty(0, dtype=torch.long))
    assert out.shape == (0, HEADS, HEAD_DIM) and npu == []


def test_what_the_kernels_cannot_take_fails_clearly(npu):
    ops = NpuPagedOps()
    kc, vc = _caches(2, torch.float32)
    with pytest.raises(TypeError, match="bfloat16 here, not torch.float32"):
        ops.decode_attention(torch.randn(1, HEADS, HEAD_DIM), kc, vc, torch.zeros(1, 1, dtype=torch.long),
                             torch.tensor([3]), SCALE)
    small = torch.zeros(4, 16, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)  # the CPU block size
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.prefill_attention(torch.zeros(4, HEADS, HEAD_DIM, dtype=torch.bfloat16), small, small,
                              torch.tensor([0]), 4, SCALE)
    assert npu == []


def test_torch_npu_is_imported_when_the_ops_are_made(monkeypatch):
    # not when epdserve.ops.npu_ops is imported; at construction, to probe the operators once
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # importing it raises
    with pytest.raises(ImportError):
        NpuPagedOps()
