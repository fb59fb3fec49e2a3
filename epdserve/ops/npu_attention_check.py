"""`check_npu_attention(torch_npu, spec, device)`: can this NPU run our attention call for a model
of this dtype and head_dim? Asked once, at engine start-up, before the KV cache is allocated, so a
model or a CANN the kernel refuses stops the engine with `NpuKernelsUnsupported` and its fix —
never at the first request.

The call (ops/npu_ops.py): `npu_fused_infer_attention_score` with input_layout "TND" and a block
table. FIA hands TND with a paged KV to PFA's tiling, which refuses (hicann/ops-transformer
attention/prompt_flash_attention/op_host/prompt_flash_attention_tiling.cpp,
`PromptFlashAttentionTiling::CheckInputShapeWhenLayoutIsTND`):
- any input dtype but bf16: "When layout is %s, inputDataType should be bf16" — fp16 included;
- a head_dim other than 64 / 128 (query, key and value equal) or 192 (query and key; value 192 or
  128), and 192 with grouped-query attention: "When G not 1, valueD should not be 192".
Those two are checked from the model's KV spec, without a kernel call.

What the source cannot say is whether the installed CANN's kernel takes TND with a paged KV at
all: vllm-ascend issue #4373 ("When layout is TND, not support Page Attention", vllm-ascend
0.11.0rc1, whose README asks for CANN 8.3.RC1) and issue #8045 (torch-npu 2.8.0, the 8.3.RC1
build: "When layout is TND, queryD(128) or keyD(128) must be 192") report it refused; vllm-ascend
v0.11.0 attended decode-only steps with the ATB `_npu_paged_attention` (vllm_ascend/attention/
attention_v1.py `_forward_decode_only`), while v0.13.0 (README: CANN 8.3.rc2, torch-npu 2.8.0)
makes our call for every step (`forward_fused_infer_attention`). So the
check then makes one tiny step of exactly our shape — the KV write the engine will use
(`reshape_and_cache`, its schema as ops/npu_schema.py found it) of the step's new tokens, then
attention over a decode row in one block, a two-token prompt chunk with the causal mask, and a
decode row whose context crosses a block boundary (two blocks, out of order) — and compares the
written cache rows and the attention with the same computed in float32 on the device; a refusal (the aclnn error, e.g. 561002) or a wrong answer stops the
engine, naming the CANN (`torch_npu.utils.get_cann_version()`, torch_npu/npu/utils.py on
v2.8.0-7.2.0, v2.9.0-7.3.0 and v2.12.0-26.1.0) and the extras that carry a CANN which takes it.
"""
from __future__ import annotations

import torch

from epdserve.ops.npu_schema import NpuKernelsUnsupported

TND_DTYPE = torch.bfloat16
TND_HEAD_DIMS = (64, 128, 192)
EXTRAS_FIX = ("install the [npu] extra (torch_npu 2.12.0, CANN 9.1.0) or [npu-cann85] (torch_npu 2.9.0, "
              "CANN 8.5.0) with its CANN ([npu-cann83] needs CANN 8.3.RC2 or later of that line); the README's "
              "Ascend table says what each extra supports")


def cann_version(torch_npu) -> str:
    """The CANN the runtime reports ("" where it cannot: CANN older than 8.1.RC1, GetCANNInfo.cpp)."""
    get = getattr(getattr(torch_npu, "utils", None), "get_cann_version", None)
    try:
        return str(get("CANN")) if get is not None else ""
    except Exception:
        return ""


def check_model_shape(dtype: torch.dtype, head_dim: int, num_heads: int | None = None,
                      num_kv_heads: int | None = None) -> None:
    """Refuse, with the fix, what PFA's TND tiling refuses (module docstring)."""
    if dtype != TND_DTYPE:
        raise NpuKernelsUnsupported(
            f"the NPU attention kernel (npu_fused_infer_attention_score, TND layout with a paged KV cache) takes "
            f"bfloat16 only, not {dtype} (ops-transformer prompt_flash_attention_tiling.cpp: \"inputDataType should "
            "be bf16\"): run the model with --dtype bfloat16")
    if head_dim not in TND_HEAD_DIMS:
        raise NpuKernelsUnsupported(
            f"the NPU attention kernel takes head_dim 64, 128 or 192 in the TND layout, this model has {head_dim} "
            "(ops-transformer prompt_flash_attention_tiling.cpp CheckInputShapeWhenLayoutIsTND): it cannot run "
            "on NPU with epdserve")
    if head_dim == 192 and num_heads and num_kv_heads and num_heads != num_kv_heads:
        raise NpuKernelsUnsupported(
            "the NPU attention kernel refuses head_dim 192 with grouped-query attention (ops-transformer "
            "prompt_flash_attention_tiling.cpp: \"When G not 1, valueD should not be 192\")")


def check_npu_attention(ops, spec, num_heads: int, device: torch.device) -> None:
    """Run `ops` (an NpuPagedOps) once on a tiny batch of the model's shape on `device`; raise
    NpuKernelsUnsupported when the kernel refuses it or answers wrongly."""
    check_model_shape(spec.dtype, spec.head_dim, num_heads, spec.num_kv_heads)
    bs, kvh, d = spec.block_size, spec.num_kv_heads, spec.head_dim
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(4, bs, kvh, d, generator=g).to(spec.dtype).to(device)
    vc = torch.randn(4, bs, kvh, d, generator=g).to(spec.dtype).to(device)
    q, new_k, new_v = (torch.randn(4, h, d, generator=g).to(spec.dtype).to(device)
                       for h in (num_heads, kvh, kvh))  # one per probe row (_probe_rows)
    from epdserve.ops.attention_meta import VarlenBatch

    cann = cann_version(ops._torch_npu()) or "unknown (older than 8.1.RC1?)"
    # the step's new tokens into the cache, by the write the engine uses: each query row's own token
    rows = _probe_rows(bs)
    slots = [table[(n - 1) // bs] * bs + (n - 1) % bs for table, n in rows]
    try:
        ops.reshape_and_cache(new_k, new_v, kc, vc, torch.tensor(slots, dtype=ops.index_dtype).to(device))
    except Exception as e:
        raise NpuKernelsUnsupported(f"this CANN ({cann}) refuses the KV cache write ({type(e).__name__}: {e}). "
                                    f"Fix: {EXTRAS_FIX}") from e
    for cache, new in ((kc, new_k), (vc, new_v)):
        if not torch.equal(cache.view(-1, kvh, d)[torch.tensor(slots)].cpu(), new.cpu()):
            raise NpuKernelsUnsupported(f"this CANN ({cann})'s KV cache write put the tokens in the wrong place. "
                                        f"Fix: {EXTRAS_FIX}")
    # request 0: a decode row over 5 keys (block 0); request 1: a 2-token chunk over 3 keys (block 1);
    # request 2: a decode row over bs + 3 keys of blocks 3 then 2 (a block boundary, out of order)
    tables = torch.tensor([[0, 0], [1, 0], [3, 2]], dtype=torch.int32).to(device)
    batch = VarlenBatch(tables, (1, 3, 4), (5, 3, bs + 3))
    scale = d ** -0.5
    try:
        out = ops.varlen_attention(q, kc, vc, batch, scale)
    except Exception as e:  # the aclnn error (e.g. 561002) the kernel's tiling raised
        raise NpuKernelsUnsupported(
            f"this CANN ({cann}) refuses npu_fused_infer_attention_score with input_layout TND and a paged KV "
            f"cache at this model's head_dim {d} ({num_heads} query / {kvh} KV heads, {spec.dtype}; op-plugin's "
            f"TND docs list head_dim 128 and 192) (as vllm-ascend issues #4373 / #8045 report for CANN 8.3.RC1): "
            f"{type(e).__name__}: {e}. "
            f"Fix: {EXTRAS_FIX}") from e
    want = _reference(q, kc, vc, scale)
    err = (out.float() - want).abs().max().item()  # start-up only: one read
    if not err <= 0.05:
        raise NpuKernelsUnsupported(
            f"this CANN ({cann})'s npu_fused_infer_attention_score (TND, paged) answers wrongly: max error {err:.3g} "
            f"against float32 on a three-request batch. Fix: {EXTRAS_FIX}")


def _probe_rows(bs: int) -> list[tuple[tuple[int, ...], int]]:
    """Per query row of the probe: (its request's blocks in order, keys it sees): row 0 a decode row
    over 5 keys of block 0; rows 1-2 a chunk ending at key 2 of block 1 (right-down causal: 2 and 3
    keys); row 3 a decode row over block 3 whole and 3 keys of block 2."""
    return [((0,), 5), ((1,), 2), ((1,), 3), ((3, 2), bs + 3)]


def _reference(q, kc, vc, scale) -> torch.Tensor:
    """The probe batch's attention in float32, row by row (`_probe_rows`)."""
    heads, kvh = q.shape[1], kc.shape[2]
    rows = []
    for i, (blocks, n) in enumerate(_probe_rows(kc.shape[1])):
        k = torch.cat([kc[b] for b in blocks])[:n].float().repeat_interleave(heads // kvh, dim=1)  # [n, heads, d]
        v = torch.cat([vc[b] for b in blocks])[:n].float().repeat_interleave(heads // kvh, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        rows.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(rows)
