"""Binary value layout of one stored feature (a list of tensors); never pickle.

Layout, little-endian::

    header   magic b"EPMF" | format version u16 | tensor count u16 | xxh3-64 of the rest u64
    key      the media key it was stored under: length u16 | UTF-8 bytes
    table    per tensor: dtype code u8 | ndim u8 | shape ndim x u64 | nbytes u64
    payload  the tensors' raw bytes, back to back, in table order

Every dtype travels as its raw bytes (a uint8 view), so bf16 round-trips bit-exactly with no
numpy bf16 support needed. The checksum (xxh3-64 runs at >10 GB/s; a checksum against
corruption, not forgery, so a fast unkeyed hash is right here) turns a truncated or
corrupted value into a `CorruptFeatureError` instead of silently wrong embeddings; a value of
another format version is refused the same way, so a rolling upgrade recomputes instead of
misreading. Several tensors per value carry Qwen3-VL's deepstack features next to the main
embedding.

The key inside the checksummed value ties the value to its key: `decode(value, key)` refuses a
value stored under another key (`ForeignFeatureError`), so two entries swapped or copied in the
server are recomputed, never served as another image's features. (This catches swaps and
misplacements; who may write at all is the server's password / ACL.)
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

MAGIC = b"EPMF"
FORMAT_VERSION = 3  # 2: the key inside the value; 3: keyed media keys (values under forgeable xxh3 keys die)
MAX_TENSORS = 1024
MAX_KEY_BYTES = 1024
_HEADER = struct.Struct("<4sHHQ")
_KEYLEN = struct.Struct("<H")
_ENTRY = struct.Struct("<BB")
_U64 = struct.Struct("<Q")

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class CorruptFeatureError(ValueError):
    """A stored value is truncated, corrupted, or written by another format version."""


class ForeignFeatureError(CorruptFeatureError):
    """A stored value is intact but was stored under another key (entries swapped or copied)."""


def encode(tensors: Sequence[torch.Tensor], key: str = "") -> memoryview:
    """Serialize tensors (any device; copied to host) into one bytes-like value (one copy of the
    data), bound to `key` (the media key it will be stored under)."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"a feature value holds 1..{MAX_TENSORS} tensors, got {len(tensors)}")
    key_bytes = key.encode()
    if len(key_bytes) > MAX_KEY_BYTES:
        raise ValueError(f"a media key is at most {MAX_KEY_BYTES} bytes, got {len(key_bytes)}")
    table: list[bytes] = [_KEYLEN.pack(len(key_bytes)), key_bytes]
    payload: list[memoryview] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {i} of the feature is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _DTYPE_CODES:
            raise TypeError(f"tensor {i} has dtype {t.dtype}, which the feature codec does not carry")
        if t.ndim > 255:
            raise ValueError(f"tensor {i} has {t.ndim} dims; at most 255 are supported")
        raw = _raw_bytes(t)
        table.append(_ENTRY.pack(_DTYPE_CODES[t.dtype], t.ndim))
        table.extend(_U64.pack(d) for d in t.shape)
        table.append(_U64.pack(raw.nbytes))
        payload.append(raw)
    table_bytes = b"".join(table)
    total = _HEADER.size + len(table_bytes) + sum(p.nbytes for p in payload)
    # One preallocated buffer: measurably faster than b"".join over large memoryviews.
    buf = np.empty(total, dtype=np.uint8)
    off = _HEADER.size
    for part in (table_bytes, *payload):
        buf[off : off + len(part)] = np.frombuffer(part, dtype=np.uint8)
        off += len(part)
    out = memoryview(buf).cast("B")
    checksum = xxhash.xxh3_64_intdigest(out[_HEADER.size :])
    _HEADER.pack_into(out, 0, MAGIC, FORMAT_VERSION, len(tensors), checksum)
    return out


def decode(value: bytes | bytearray | memoryview, key: str | None = None) -> list[torch.Tensor]:
    """Parse a value back into fresh, writable host tensors (one copy; the value can be freed).
    With `key`, a value stored under another key raises `ForeignFeatureError`."""
    mv = memoryview(value).cast("B")
    if len(mv) < _HEADER.size:
        raise CorruptFeatureError(f"feature value is truncated: {len(mv)} bytes, shorter than its header")
    magic, version, count, checksum = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptFeatureError(f"not an epdserve feature value (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise CorruptFeatureError(
            f"feature value has format version {version}; this epdserve reads version {FORMAT_VERSION}"
        )
    if xxhash.xxh3_64_intdigest(mv[_HEADER.size:]) != checksum:
        raise CorruptFeatureError("feature value is corrupt or truncated (checksum mismatch)")
    if not 1 <= count <= MAX_TENSORS:
        raise CorruptFeatureError(f"feature value claims {count} tensors")

    specs: list[tuple[torch.dtype, tuple[int, ...], int]] = []
    off = _HEADER.size
    try:
        (key_len,) = _KEYLEN.unpack_from(mv, off)
        off += _KEYLEN.size
        stored_key = bytes(mv[off : off + key_len])
        off += key_len
        if key is not None and stored_key != key.encode():
            raise ForeignFeatureError(f"value was stored under key {stored_key.decode(errors='replace')!r}, "
                                      f"not {key!r}")
        for _ in range(count):
            code, ndim = _ENTRY.unpack_from(mv, off)
            off += _ENTRY.size
            shape = struct.unpack_from(f"<{ndim}Q", mv, off)
            off += 8 * ndim
            (nbytes,) = _U64.unpack_from(mv, off)
            off += _U64.size
            if code not in _CODE_DTYPES:
                raise CorruptFeatureError(f"feature value has unknown dtype code {code}")
            dtype = _CODE_DTYPES[code]
            if nbytes != _numel(shape) * _itemsize(dtype):
                raise CorruptFeatureError(f"tensor of shape {shape} and {dtype} cannot hold {nbytes} bytes")
            specs.append((dtype, shape, nbytes))
    except struct.error as e:
        raise CorruptFeatureError(f"feature value table is truncated: {e}") from None
    if off + sum(s[2] for s in specs) != len(mv):
        raise CorruptFeatureError(
            f"feature value is {len(mv)} bytes but its table describes {off + sum(s[2] for s in specs)}"
        )

    out = []
    for dtype, shape, nbytes in specs:
        t = torch.empty(shape, dtype=dtype)
        if nbytes:
            t.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(mv, np.uint8, nbytes, off)
        off += nbytes
        out.append(t)
    return out


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
