"""Run with TRITON_INTERPRET=1 (tests/ops/test_triton_decode.py starts it so): the Triton paged
decode kernel against the portable op on the cases below; prints one JSON line per case with the
largest error and the bound it must meet."""
import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "Triton reads TRITON_INTERPRET when the kernel is decorated"

import torch  # noqa: E402

from epdserve.engine.kv_cache import KVCacheSpec  # noqa: E402
from epdserve.ops.portable import PortableOps  # noqa: E402
from epdserve.ops.triton_decode import paged_decode_attention  # noqa: E402

# (name, heads, kv_heads, head_dim, block_size, contexts): GQA 4:1 and 2:1, MHA, a head_dim that is
# not a power of two, contexts ending inside, at and just past a block, one of a single token, and
# a row with no context (graph padding rows attend only the pad block; an empty row gets zeros)
CASES = [
    ("gqa4", 8, 2, 16, 16, [1, 15, 16, 17, 40, 63]),
    ("gqa2-d64", 4, 2, 64, 16, [33, 5]),
    ("mha", 4, 4, 32, 8, [9, 24, 1]),
    ("d24", 6, 3, 24, 16, [20, 47]),
    ("empty-row", 2, 1, 16, 16, [0, 18]),
]

gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for name, H, KVH, D, BS, ctx in CASES:
        B, nb = len(ctx), max(1, -(-max(ctx) // BS))
        blocks = B * nb + 3
        kc = torch.randn(blocks, BS, KVH, D, generator=gen).to(dtype)
        vc = torch.randn(blocks, BS, KVH, D, generator=gen).to(dtype)
        q = torch.randn(B, H, D, generator=gen).to(dtype)
        perm = torch.randperm(blocks, generator=gen)[: B * nb].view(B, nb)  # scattered, out-of-order blocks
        ctx_t = torch.tensor(ctx, dtype=torch.long)
        got = paged_decode_attention(q, kc, vc, perm, ctx_t, D ** -0.5).float()
        live = ctx_t > 0
        want = torch.zeros_like(got)
        want[live] = PortableOps().decode_attention(q[live], kc, vc, perm[live], ctx_t[live], D ** -0.5).float()
        # fp32: summation order only; bf16: both round the output to bf16 (2^-8 relative each) from fp32 sums
        bound = 1e-5 if dtype == torch.float32 else 2 ** -7 * max(1.0, want.abs().max().item())
        print(json.dumps({"case": f"{name}-{str(dtype)[6:]}", "err": (got - want).abs().max().item(), "bound": bound,
                          "empty_rows_zero": bool((got[~live] == 0).all()), "shape_ok": list(got.shape) == [B, H, D]}))

# the start-up check an engine runs on its device (ops/triton_ops.py): passes with the kernel as it is
from epdserve.ops.triton_ops import TritonOps  # noqa: E402

for dtype in (torch.float32, torch.bfloat16):
    TritonOps().check_kv_spec(KVCacheSpec(2, 2, 24, 16, dtype), 6, "cpu")
print(json.dumps({"startup_check": "ok"}))
