"""`TritonOps`: the paged operators on CUDA — decode attention as one Triton kernel reading the
blocks where they lie (ops/triton_decode.py); the KV write and a later prompt chunk's attention
as the portable ones (ops/portable.py: index_copy, gather + SDPA). Chosen by ops/select.py for
CUDA when Triton imports (it comes with xgrammar); `EPDSERVE_OPS=portable` picks the portable
operators instead."""
from __future__ import annotations

from epdserve.ops.portable import PortableOps


class TritonOps(PortableOps):
    name = "triton"

    def __init__(self):
        super().__init__()
        from epdserve.ops.triton_decode import paged_decode_attention  # Triton: imported only when chosen

        self._decode = paged_decode_attention

    def check_kv_spec(self, spec, num_heads: int, device) -> None:
        """At start-up: a power-of-two block size, and the kernel compiled and run once on this
        device at the model's shapes (two requests, one over four blocks) equal to the portable op
        within bf16 rounding — so a Triton that cannot build it here fails the start, not a step."""
        import torch

        bs = spec.block_size
        if bs & (bs - 1):
            raise ValueError(f"the Triton decode kernel needs a power-of-two KV block size, got {bs}: use "
                             f"--block-size 16 (CUDA's default), or EPDSERVE_OPS=portable")
        gen = torch.Generator().manual_seed(0)
        shape = (8, bs, spec.num_kv_heads, spec.head_dim)
        kc, vc = (torch.randn(shape, generator=gen).to(device=device, dtype=spec.dtype) for _ in range(2))
        q = torch.randn(2, num_heads, spec.head_dim, generator=gen).mul(4).to(device=device, dtype=spec.dtype)
        tables = torch.tensor([[6, 0, 3, 5], [2, 7, 1, 4]], dtype=self.index_dtype, device=device)
        ctx = torch.tensor([3 * bs + 5, bs // 2 + 1], dtype=self.index_dtype, device=device)
        scale = spec.head_dim ** -0.5
        try:
            got = self._decode(q, kc, vc, tables, ctx, scale).float()
        except Exception as e:
            raise ValueError(f"the Triton decode kernel does not run here ({type(e).__name__}: {e}); set "
                             f"EPDSERVE_OPS=portable") from e
        want = PortableOps.decode_attention(PortableOps(), q, kc, vc, tables, ctx, scale).float()
        err = float((got - want).abs().max())
        if not err <= 2 ** -6:  # bf16 rounding of outputs of size ~1, twice; NaN fails too
            raise ValueError(f"the Triton decode kernel's output differs from the portable op's by {err:.3g} on "
                             f"{device}; set EPDSERVE_OPS=portable")

    def decode_attention(self, query, key_cache, value_cache, block_tables, ctx_lens, scale):
        return self._decode(query, key_cache, value_cache, block_tables, ctx_lens, scale)
