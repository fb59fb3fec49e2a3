"""`NativeOps`: the csrc/ C++ operators (`torch.ops.epdserve.*`), built on first use.

Shape functions ("fake" kernels) are registered here too, so the operators trace under
torch.compile / FakeTensor like any ATen operator (and pass `torch.library.opcheck`).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from epdserve.ops.backend import PagedOps
from epdserve.ops.native_build import build_and_load
from epdserve.ops.portable import prefill_attention as gathered_prefill_attention


def load_native_ops() -> "NativeOps":
    """Build/load the library (cached) and return the operators; raises if they cannot be built."""
    build_and_load()
    _register_fakes()
    return NativeOps()


@lru_cache(maxsize=None)  # registering twice would raise: once per process, like the library itself
def _register_fakes() -> tuple:

    def decode(query, key_cache, value_cache, block_tables, ctx_lens, scale):
        return query.new_empty(query.shape)

    def prefill(query, key_cache, value_cache, block_table, ctx_len, scale):
        return query.new_empty(query.shape)

    def cache(key, value, key_cache, value_cache, slots):
        return None

    return tuple(torch.library.register_fake(f"epdserve::{name}", fn) for name, fn in (
        ("paged_decode_attention", decode), ("paged_prefill_attention", prefill), ("reshape_and_cache", cache)))


class NativeOps(PagedOps):
    """Decode reads the blocks in place, with no gather. A later prefill chunk of at most
    `prefill_native_max` query tokens runs the native kernel; a longer one gathers the request's
    blocks once and runs torch's SDPA, because the kernel's cost grows with q_len x context and
    the gather's only with context (crossover: README 'Paged operators'; per-chunk figures:
    docs/measurements.md)."""

    name = "native"
    prefill_native_max = 2

    def reshape_and_cache(self, key, value, key_cache, value_cache, slots):
        torch.ops.epdserve.reshape_and_cache(key, value, key_cache, value_cache, slots)

    def decode_attention(self, query, key_cache, value_cache, block_tables, ctx_lens, scale):
        return torch.ops.epdserve.paged_decode_attention(query, key_cache, value_cache, block_tables, ctx_lens,
                                                         float(scale))

    def prefill_attention(self, query, key_cache, value_cache, block_table, ctx_len, scale):
        if query.shape[0] > self.prefill_native_max:
            return gathered_prefill_attention(query, key_cache, value_cache, block_table, ctx_len, scale)
        return torch.ops.epdserve.paged_prefill_attention(query, key_cache, value_cache, block_table, int(ctx_len),
                                                          float(scale))
