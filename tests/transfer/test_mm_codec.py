"""Feature value codec: bit-exact round trips and clear errors for bad values."""
import struct

import pytest
import torch

from epdserve.transfer.mm_store import codec
from epdserve.transfer.mm_store.codec import CorruptFeatureError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _assert_bit_equal(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a.contiguous()), _bits(b))


def _features(dtype, n):
    g = torch.Generator().manual_seed(n)
    # deepstack-like: a main embedding plus smaller extra tensors; include NaN/inf/-0 bit patterns
    ts = [torch.randn(64 // (i + 1), 32, generator=g).to(dtype) for i in range(n)]
    ts[0][0, :3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    return ts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3])
def test_round_trip_bit_exact(dtype, n):
    tensors = _features(dtype, n)
    _assert_bit_equal(tensors, codec.decode(codec.encode(tensors)))


def test_round_trip_keeps_shapes_of_views_scalars_and_empties():
    base = torch.randn(8, 6).bfloat16()
    tensors = [base.t(), base[:, 1:3], torch.tensor(2.5), torch.zeros(0, 7, dtype=torch.float16)]
    _assert_bit_equal(tensors, codec.decode(bytes(codec.encode(tensors))))


def test_decoded_tensors_are_writable_and_independent_of_the_value():
    value = bytearray(codec.encode([torch.ones(4)]))
    (t,) = codec.decode(value)
    t.add_(1)  # must not warn or fail: decode copies into fresh memory
    value[-4:] = b"\0\0\0\0"
    assert t.tolist() == [2.0, 2.0, 2.0, 2.0]


def test_truncated_value_is_reported():
    value = bytes(codec.encode([torch.randn(16, 16)]))
    for cut in (3, 10, len(value) - 1):
        with pytest.raises(CorruptFeatureError, match="truncated|checksum"):
            codec.decode(value[:cut])


def test_flipped_byte_is_reported():
    value = bytearray(codec.encode([torch.randn(16, 16)]))
    value[len(value) // 2] ^= 0x40
    with pytest.raises(CorruptFeatureError, match="corrupt"):
        codec.decode(value)


def test_other_format_version_is_reported():
    value = bytearray(codec.encode([torch.randn(2)]))
    struct.pack_into("<H", value, 4, codec.FORMAT_VERSION + 1)
    with pytest.raises(CorruptFeatureError, match="format version"):
        codec.decode(value)


def test_foreign_value_is_reported():
    with pytest.raises(CorruptFeatureError, match="not an epdserve feature"):
        codec.decode(b"\x80\x04\x95pickled-stuff-here")


@pytest.mark.parametrize(
    "bad, match",
    [([], "1..1024"), ([torch.zeros(2), "x"], "not a torch.Tensor"), ([torch.zeros(2, dtype=torch.complex64)], "dtype")],
)
def test_bad_input_is_refused_with_a_message(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        codec.encode(bad)
