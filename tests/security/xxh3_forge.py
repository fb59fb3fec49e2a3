"""Forging against the hashes epdserve used before issue 35, from XXH3's public default secret.

- `colliding_ppms`: two valid, different 64x64 PPM images with one xxh3-128 (and xxh3-64), in
  milliseconds. XXH3's long-input loop adds, per 8-byte lane, ``lo32(v ^ s) * hi32(v ^ s)`` to one
  accumulator and ``v`` to its neighbour, `s` the secret word of that lane and stripe. A lane whose
  high half equals the secret's makes the product 0, so it adds only ``v``; two such lanes of one
  lane index in two stripes of one block may trade any amount between their low halves and the
  accumulators never see it. Pixel bytes of a binary PPM are free, so every lane of every full
  block can be traded: the images differ in thousands of bytes.
- `forge_block`: token ids of a first KV block whose old prefix-cache hash (xxh3-64 of 8 zero
  bytes then 16 int64 token ids: the 129..240-byte path, a sum of eight ``mix16B`` terms) equals a
  victim block's, by Wagner's 4-list generalised birthday over the first 14 tokens (the last two
  are kept). It takes seconds and a few hundred MB, so tests use the blocks it found
  (`tests/security/test_forged_identity.py`), checking the collision with xxhash itself.

Test tooling only: nothing in epdserve imports it.
"""
from __future__ import annotations

import random
import struct

import numpy as np

# XXH3's default secret (xxhash.h `XXH3_kSecret`, public): 192 bytes
K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_STRIPE, _BLOCK = 64, 1024  # XXH3 long input: 16 stripes of 64 bytes per block with the default secret


def _secret_hi(offset: int) -> int:
    return struct.unpack_from("<Q", K_SECRET, offset)[0] >> 32


def colliding_ppms(width: int = 64, height: int = 64, seed: int = 0) -> tuple[bytes, bytes]:
    """Two different binary PPM images (P6) of `width` x `height` with equal xxh3-128."""
    header = f"P6\n{width} {height}\n255\n".encode()
    n = len(header) + 3 * width * height
    rng = random.Random(seed)
    a = bytearray(header + rng.randbytes(3 * width * height))
    b = bytearray(a)
    for blk in range((n - 1) // _BLOCK):  # full blocks only (the last one is hashed again at another offset)
        for lane in range(8):
            for s in range(0, 16, 2):
                offs = [blk * _BLOCK + (s + k) * _STRIPE + 8 * lane for k in (0, 1)]
                if offs[0] < len(header) or offs[1] + 8 > n - _STRIPE:
                    continue  # the header, or the last stripe's bytes
                x, y, d = rng.randrange(1 << 30, 3 << 30), rng.randrange(1 << 30, 3 << 30), rng.randrange(1 << 28, 1 << 29)
                for off, lo_a, lo_b, sec in ((offs[0], x, x + d, 8 * (s + lane)), (offs[1], y, y - d, 8 * (s + 1 + lane))):
                    hi = _secret_hi(sec) << 32
                    struct.pack_into("<Q", a, off, hi | lo_a)
                    struct.pack_into("<Q", b, off, hi | lo_b)
    return bytes(a), bytes(b)


# ---------------------------------------------------------------- a forged first KV block
_U = np.uint64
_M32 = _U(0xFFFFFFFF)


def _word(offset: int) -> np.uint64:
    return _U(struct.unpack_from("<Q", K_SECRET, offset)[0])


def _mul_fold(a, b):
    """XXH3_mul128_fold64 on uint64 arrays: the 128-bit product's halves XORed."""
    a0, a1, b0, b1 = a & _M32, a >> _U(32), b & _M32, b >> _U(32)
    ll, hl, lh, hh = a0 * b0, a1 * b0, a0 * b1, a1 * b1
    cross = (ll >> _U(32)) + (hl & _M32) + lh
    upper = (hl >> _U(32)) + (cross >> _U(32)) + hh
    return ((cross << _U(32)) | (ll & _M32)) ^ upper


def _mix(i: int, lo, hi):
    """XXH3_mix16B of the i-th 16 bytes (seed 0)."""
    return _mul_fold(lo ^ _word(16 * i), hi ^ _word(16 * i + 8))


def _join(x, y, mask):
    """Index pairs (i, j) with x[i] + y[j] == 0 in the bits of `mask`."""
    ky = y & mask
    order = np.argsort(ky, kind="stable")
    ks = ky[order]
    want = (_U(0) - x) & mask
    lo, hi = np.searchsorted(ks, want, "left"), np.searchsorted(ks, want, "right")
    cnt = hi - lo
    xi = np.repeat(np.arange(len(x)), cnt)
    yj = order[np.repeat(lo - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))]
    return xi, yj


_GROUPS = ((0, 3), (3, 7), (7, 11), (11, 14))  # the tokens each list varies: chunks (0,1) (2,3) (4,5) (6,7)


def forge_block(victim: list[int], allowed: list[int], size: int = 3_000_000, seed: int = 0) -> list[list[int]]:
    """First blocks (16 token ids from `allowed`, the last two the victim's) whose xxh3-64 of
    ``8 zero bytes + int64 tokens`` equals the victim's; usually a few, maybe none (another seed)."""
    if len(victim) != 16:
        raise ValueError("a block of 16 token ids")
    rng = np.random.default_rng(seed)
    words = [_U(0), *(_U(t) for t in victim)]  # [previous hash = 0 | t0 .. t15]: 17 words, chunks of two
    target = _U(0)
    for i in range(8):
        target += _mix(i, np.array([words[2 * i]]), np.array([words[2 * i + 1]]))[0]
    pool = np.asarray(allowed, dtype=np.int64)
    lists, picks = [], []
    for a, b in _GROUPS:
        pick = pool[rng.integers(0, len(pool), size=(size, b - a))]
        col = {1 + a + k: pick[:, k].astype(_U) for k in range(b - a)}  # word index -> its values
        val = np.zeros(size, dtype=_U)
        for i in range(8):
            if 2 * i in col or 2 * i + 1 in col:
                val += _mix(i, col.get(2 * i, words[2 * i]), col.get(2 * i + 1, words[2 * i + 1]))
        lists.append(val)
        picks.append(pick)
    lists[3] = lists[3] - target
    low = _U((1 << 21) - 1)
    i0, i1 = _join(lists[0], lists[1], low)
    i2, i3 = _join(lists[2], lists[3], low)
    p, q = _join(lists[0][i0] + lists[1][i1], lists[2][i2] + lists[3][i3], _U(0xFFFFFFFFFFFFFFFF))
    out = []
    for x, y in zip(p, q):
        block = list(victim)
        for (a, b), pick, idx in zip(_GROUPS, picks, (i0[x], i1[x], i2[y], i3[y])):
            block[a:b] = pick[idx].tolist()
        if block != list(victim):
            out.append(block)
    return out


def old_block_hash(token_ids: list[int], prev: int = 0) -> int:
    """The prefix-cache block hash before issue 35 (engine/prefix_hash.py, xxh3-64, no media)."""
    import xxhash

    h = xxhash.xxh3_64(struct.pack("<Q", prev))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.intdigest()


if __name__ == "__main__":  # print forged blocks for a victim block: python -m tests.security.xxh3_forge ID ...
    import sys

    victim = [int(x) for x in sys.argv[1:17]]
    for forged in forge_block(victim, list(range(1990))):
        assert old_block_hash(forged) == old_block_hash(victim)
        print(forged)
