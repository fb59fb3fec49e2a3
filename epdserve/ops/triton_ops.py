"""`TritonOps`: the paged operators on CUDA — decode attention as one Triton kernel reading the
blocks where they lie (ops/triton_decode.py); the KV write as one Triton kernel writing K and V at
their slots (ops/triton_layer.py; a negative slot writes nothing); a later prompt chunk's
attention as the portable one (ops/portable.py: gather + SDPA). Chosen by ops/select.py for
CUDA when Triton imports (it comes with xgrammar); `EPDSERVE_OPS=portable` picks the portable
operators instead."""
from __future__ import annotations

from epdserve.ops.portable import PortableOps


class TritonOps(PortableOps):
    name = "triton"

    def __init__(self):
        super().__init__()
        from epdserve.ops.triton_decode import paged_decode_attention  # Triton: imported only when chosen
        from epdserve.ops.triton_layer import reshape_and_cache

        self._decode = paged_decode_attention
        self._write = reshape_and_cache

    def check_kv_spec(self, spec, num_heads: int, device) -> None:
        """At start-up: a power-of-two block size, and the kernels compiled and run once on this
        device at the model's shapes — decode attention (two requests, one over four blocks) within
        bf16 rounding of the portable op, then the KV write (five tokens at scattered slots, K and
        V read through strided views) equal to the portable one bit for bit — so a Triton that
        cannot build them here fails the start, not a step."""
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
        self._check_write(kc, vc, gen)

    def _check_write(self, kc, vc, gen) -> None:
        import torch

        _, bs, kvh, d = kc.shape
        kv = torch.randn(5, 2 * kvh * d + 3, generator=gen).to(device=kc.device, dtype=kc.dtype)
        k, v = kv[:, : kvh * d].view(5, kvh, d), kv[:, kvh * d: 2 * kvh * d].view(5, kvh, d)  # strided, like qkv's
        slots = torch.tensor([3 * bs + 1, 0, 7 * bs + bs - 1, bs, 5 * bs + 2], dtype=self.index_dtype, device=kc.device)
        got, want = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
        try:
            self.reshape_and_cache(k, v, *got, slots)
        except Exception as e:
            raise ValueError(f"the Triton KV-write kernel does not run here ({type(e).__name__}: {e}); set "
                             f"EPDSERVE_OPS=portable") from e
        PortableOps.reshape_and_cache(self, k, v, *want, slots)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise ValueError(f"the Triton KV-write kernel's caches differ from the portable op's on {kc.device}; "
                             f"set EPDSERVE_OPS=portable")

    def reshape_and_cache(self, key, value, key_cache, value_cache, slots):
        self._write(key, value, key_cache, value_cache, slots)

    def decode_attention(self, query, key_cache, value_cache, block_tables, ctx_lens, scale):
        return self._decode(query, key_cache, value_cache, block_tables, ctx_lens, scale)
