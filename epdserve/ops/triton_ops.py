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
        bs = spec.block_size
        if bs & (bs - 1):
            raise ValueError(f"the Triton decode kernel needs a power-of-two KV block size, got {bs}: use "
                             f"--block-size 16 (CUDA's default), or EPDSERVE_OPS=portable")

    def decode_attention(self, query, key_cache, value_cache, block_tables, ctx_lens, scale):
        return self._decode(query, key_cache, value_cache, block_tables, ctx_lens, scale)
