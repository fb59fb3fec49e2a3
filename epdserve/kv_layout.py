"""The registration record of an instance that holds request KV: what its KV looks like and how
it is split over its ranks, so the scheduler can refuse a prefill–decode pair that cannot map at
registration, with both records in the message, instead of at the first request.

`KvLayout` carries the tensor-parallel degree, the KV head map (which of the model's KV heads each
rank holds: `rank_kv_heads`, the rule engine/tp/shard.py splits by; this module imports nothing of
epdserve, so every layer reads it, the scheduler's included), the layer count, head size,
tokens per block, the KV dtype and the weights' quantization method ("" = the model dtype's own
weights). `pair_mismatch(p, d)` says why P's KV cannot become D's, or None: the model's KV shape,
block size and dtype must be equal (the hop sends whole blocks as raw bytes), the weights must be
quantized alike (KV computed from other weights is another model's); any pair of degrees maps
(`hop_carries`: each D rank gets its own heads from the P ranks holding them).
It travels as `common.proto`'s `KvLayout` inside `InstanceStatus`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


def hop_carries(p_degree: int, d_degree: int) -> bool:
    """Does the layerwise KV hop carry KV from a prefill instance at `p_degree` to a decode
    instance at `d_degree`? Every pair of degrees >= 1: each D rank receives its own KV heads from P
    ranks holding them (transfer/kv/links.py). Whether the model splits at each degree is
    engine/tp/shard.py's `check_degree`, asked where the checkpoint is read."""
    return p_degree >= 1 and d_degree >= 1


def rank_kv_heads(num_kv_heads: int, degree: int, rank: int) -> range:
    """The KV heads rank `rank` of `degree` holds: num_kv_heads/degree of them when the degree
    divides them, else (a multiple of them) the one its query heads share."""
    if degree <= num_kv_heads:
        k = num_kv_heads // degree
        return range(rank * k, (rank + 1) * k)
    kv = rank * num_kv_heads // degree
    return range(kv, kv + 1)


@dataclass(frozen=True)
class KvShare:
    """One rank's place in its instance's KV split: the model's KV heads, the degree, the rank."""

    num_kv_heads: int
    degree: int = 1
    rank: int = 0

    @property
    def heads(self) -> range:
        return rank_kv_heads(self.num_kv_heads, self.degree, self.rank)


@dataclass(frozen=True)
class KvLayout:
    degree: int
    num_layers: int
    num_kv_heads: int  # the model's, over all ranks
    head_dim: int
    block_size: int
    dtype: str  # "bfloat16", "float16", "float32"
    quantization: str = ""  # the LM weights' method; "" = unquantized

    def __post_init__(self):
        for name in ("degree", "num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KvLayout.{name} must be >= 1, got {getattr(self, name)}")

    def head_map(self) -> list[range]:
        """The KV heads of each rank, rank 0 first."""
        return [rank_kv_heads(self.num_kv_heads, self.degree, r) for r in range(self.degree)]

    def describe(self) -> str:
        """One line for messages: 'TP2 (KV heads rank0 0-1, rank1 2-3 of 4), 28 layers, head_dim 64, block 16,
        bfloat16, weights bfloat16'."""
        ranks = ", ".join(f"rank{r} {h.start}-{h.stop - 1}" for r, h in enumerate(self.head_map()))
        return (f"TP{self.degree} (KV heads {ranks} of {self.num_kv_heads}), {self.num_layers} layers, "
                f"head_dim {self.head_dim}, block {self.block_size}, {self.dtype}, "
                f"weights {self.quantization or 'unquantized'}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_message(cls, msg) -> "KvLayout | None":
        """From a `common_pb2.KvLayout` (or anything with its fields); None when it is unset (degree 0:
        an instance that holds no KV, or one from before the record existed)."""
        if not msg.degree:
            return None
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})


def pair_mismatch(p: KvLayout, d: KvLayout) -> str | None:
    """Why the KV P (the prefill side) computes cannot become D's (the decode side), or None."""
    why = []
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"):
        if getattr(p, name) != getattr(d, name):
            why.append(f"{name} differs ({getattr(p, name)} vs {getattr(d, name)})")
    if p.quantization != d.quantization:
        why.append(f"the weights are quantized differently ({p.quantization or 'unquantized'} vs "
                   f"{d.quantization or 'unquantized'}): D would decode KV another model computed")
    if not why and not hop_carries(p.degree, d.degree):
        why.append(f"the KV hop does not carry P TP{p.degree} to D TP{d.degree}")
    if not why:
        return None
    return f"{'; '.join(why)} — P: {p.describe()}; D: {d.describe()}"
