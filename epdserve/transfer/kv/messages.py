"""Typed messages of the KV hop: the pair rendezvous (travels in control messages) and the
per-batch header (travels through the pair's rendezvous store as JSON). Both name the two
instances' tensor-parallel degrees: a pair's group holds every rank of both (links.py).

Nothing here is pickled: every message is a frozen dataclass with `to_json` / `from_json`, and
`from_json` rejects anything malformed with a ValueError naming the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}

SENDER_RANK, RECEIVER_RANK = 0, 1  # a two-rank pair (both TP1): group rank 0 is the prefill side
MAX_DEGREE = 64  # a tensor-parallel degree beyond any device group (bounds a malformed message)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class PairRendezvous:
    """Where and as what one process joins a P–D pair's group.

    host/port: the prefill instance's gRPC address (its `KvStore` RPC serves the pair store);
    pair_name: the store prefix of this pair, unique per pair *and* per rebuild (a torn-down
    group is rebuilt under a new name, e.g. "p0-d1/g1"). The group holds every rank of both
    instances: P's `p_degree` ranks first (group ranks 0..p-1), then D's `d_degree`
    (p..p+d-1); `rank` is this process's group rank. Group rank 0 (P's rank 0) publishes the
    batch headers; group rank p (D's rank 0) acknowledges each batch for all of D.
    """

    host: str
    port: int
    pair_name: str
    rank: int
    p_degree: int = 1
    d_degree: int = 1

    def __post_init__(self):
        _check(isinstance(self.host, str) and bool(self.host), "PairRendezvous.host must be a non-empty string")
        _check(_is_int(self.port) and 0 < self.port < 65536, f"PairRendezvous.port must be 1..65535, got {self.port!r}")
        _check(isinstance(self.pair_name, str) and bool(self.pair_name), "PairRendezvous.pair_name must be a non-empty string")
        for name in ("p_degree", "d_degree"):
            _check(_is_int(getattr(self, name)) and 1 <= getattr(self, name) <= MAX_DEGREE,
                   f"PairRendezvous.{name} must be 1..{MAX_DEGREE}, got {getattr(self, name)!r}")
        _check(_is_int(self.rank) and 0 <= self.rank < self.world,
               f"PairRendezvous.rank must be 0..{self.world - 1} (P ranks, then D ranks), got {self.rank!r}")

    @property
    def world(self) -> int:
        return self.p_degree + self.d_degree

    @property
    def prefill_side(self) -> bool:
        return self.rank < self.p_degree

    @property
    def local_rank(self) -> int:
        """This process's rank inside its own instance."""
        return self.rank if self.prefill_side else self.rank - self.p_degree

    @property
    def leader(self) -> bool:
        """Rank 0 of its instance: P's publishes headers, D's acknowledges batches."""
        return self.local_rank == 0

    def for_peer(self) -> PairRendezvous:
        """The same rendezvous as the other instance's rank 0 joins it."""
        return self.for_rank(SENDER_RANK if not self.prefill_side else self.p_degree)

    def for_rank(self, rank: int) -> PairRendezvous:
        """The same rendezvous as group rank `rank` joins it."""
        return PairRendezvous(self.host, self.port, self.pair_name, rank, self.p_degree, self.d_degree)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PairRendezvous:
        d = _load_object(text, "PairRendezvous")
        base = {"host", "port", "pair_name", "rank"}
        _check(base <= set(d) <= base | {"p_degree", "d_degree"}, f"PairRendezvous fields wrong: {sorted(d)}")
        return cls(**d)


@dataclass(frozen=True)
class RequestEntry:
    """One request in a batch: its token count and the decode-side blocks its KV goes into."""

    request_id: str
    num_tokens: int
    dst_block_ids: tuple[int, ...]

    def __post_init__(self):
        _check(isinstance(self.request_id, str) and bool(self.request_id), "request_id must be a non-empty string")
        _check(_is_int(self.num_tokens) and self.num_tokens > 0, f"{self.request_id}: num_tokens must be > 0")
        _check(all(_is_int(b) and b >= 0 for b in self.dst_block_ids), f"{self.request_id}: block ids must be ints >= 0")
        _check(len(set(self.dst_block_ids)) == len(self.dst_block_ids), f"{self.request_id}: duplicate block ids")


@dataclass(frozen=True)
class BatchHeader:
    """Announces one batch on a pair: the KV shape both sides must share — the model's layers,
    KV heads (all of them, over every rank), head size, tokens per block, dtype and the two
    degrees, from which both derive the same links (links.py) — and, in send order, the requests
    whose KV follows. `seq` numbers a pair's batches 0, 1, 2, ..."""

    seq: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    requests: tuple[RequestEntry, ...]
    p_degree: int = 1
    d_degree: int = 1

    def __post_init__(self):
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            _check(_is_int(getattr(self, name)) and getattr(self, name) > 0, f"BatchHeader.{name} must be an int > 0")
        for name in ("p_degree", "d_degree"):
            _check(_is_int(getattr(self, name)) and 1 <= getattr(self, name) <= MAX_DEGREE,
                   f"BatchHeader.{name} must be 1..{MAX_DEGREE}")
        _check(_is_int(self.seq) and self.seq >= 0, "BatchHeader.seq must be an int >= 0")
        _check(self.dtype in DTYPES, f"BatchHeader.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check(len(self.requests) > 0, "BatchHeader.requests is empty")
        ids = [r.request_id for r in self.requests]
        _check(len(set(ids)) == len(ids), "BatchHeader.requests repeats a request id")
        for r in self.requests:
            need = -(-r.num_tokens // self.block_size)
            _check(len(r.dst_block_ids) == need, f"{r.request_id}: {r.num_tokens} tokens need {need} blocks, got {len(r.dst_block_ids)}")

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def block_bytes(self, num_heads: int) -> int:
        """Bytes of one block of one layer's K (or V) for `num_heads` KV heads."""
        return self.block_size * num_heads * self.head_dim * self.element_size

    def spec_mismatch(self, spec, share) -> str | None:
        """Why a rank whose cache is `spec` and whose place is `share` (links.KvShare) cannot take
        this batch, or None when it can: the shape must be equal, the model's KV heads and the
        degrees those of the pair, and the cache must hold the heads its rank holds."""
        names = "num_layers, block_size, num_kv_heads (all ranks), head_dim, dtype, D degree"
        mine = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.d_degree)
        theirs = (spec.num_layers, spec.block_size, share.num_kv_heads, spec.head_dim, DTYPE_NAMES.get(spec.dtype),
                  share.degree)
        if mine != theirs:
            return f"KV cache shape differs: sender ({names}) = {mine}, receiver = {theirs}"
        if spec.num_kv_heads != len(share.heads):
            return (f"receiver rank {share.rank} of {share.degree} holds {spec.num_kv_heads} KV heads in its cache, "
                    f"its share of {share.num_kv_heads} is {len(share.heads)}")
        return None

    @classmethod
    def for_spec(cls, spec, seq: int, requests, share=None, d_degree: int = 1) -> BatchHeader:
        """The header of a batch sent from a cache `spec` held by `share` (None: the whole model's
        heads, degree 1) to a decode instance at `d_degree`."""
        if spec.dtype not in DTYPE_NAMES:
            raise ValueError(f"KV dtype {spec.dtype} cannot be transferred; use one of {sorted(DTYPES)}")
        heads, p_degree = (share.num_kv_heads, share.degree) if share is not None else (spec.num_kv_heads, 1)
        return cls(seq, spec.num_layers, spec.block_size, heads, spec.head_dim,
                   DTYPE_NAMES[spec.dtype], tuple(requests), p_degree, d_degree)

    def to_json(self) -> str:
        d = asdict(self)
        d["requests"] = [dict(r, dst_block_ids=list(r["dst_block_ids"])) for r in d["requests"]]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> BatchHeader:
        d = _load_object(text, "BatchHeader")
        fields = {"seq", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "requests",
                  "p_degree", "d_degree"}
        _check(set(d) == fields, f"BatchHeader fields wrong: {sorted(d)}")
        _check(isinstance(d["requests"], list), "BatchHeader.requests must be a list")
        reqs = []
        for r in d["requests"]:
            _check(isinstance(r, dict) and set(r) == {"request_id", "num_tokens", "dst_block_ids"},
                   f"BatchHeader request entry malformed: {r!r}")
            _check(isinstance(r["dst_block_ids"], list), "dst_block_ids must be a list")
            reqs.append(RequestEntry(r["request_id"], r["num_tokens"], tuple(r["dst_block_ids"])))
        return cls(**{**d, "requests": tuple(reqs)})


def _load_object(text: str | bytes, what: str) -> dict:
    try:
        d = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: not JSON ({e})") from None
    _check(isinstance(d, dict), f"{what}: expected a JSON object")
    return d
