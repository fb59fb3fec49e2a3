"""The linear-layer contract (engine/lm/linear.py): a fused projection equals its parts applied
one by one, biases where parts have them and zeros where they do not; an unknown method is
refused by name."""
from __future__ import annotations

import pytest
import torch

from epdserve.engine.lm.linear import DenseLinear, make_linear


def test_fused_parts_equal_each_part_applied_alone():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen)
    parts = [torch.randn(n, 16, generator=gen) for n in (8, 4, 4)]
    biases = [torch.randn(8, generator=gen), None, torch.randn(4, generator=gen)]
    lin = make_linear(parts, biases)
    want = torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(parts, biases)], dim=1)
    assert lin.out_features == 16 and torch.allclose(lin(x), want, atol=1e-6)
    assert len(lin.tensors()) == 2  # the fused weight and the fused bias
    plain = DenseLinear(parts[:1])
    assert torch.allclose(plain(x), x @ parts[0].t(), atol=1e-6) and plain.tensors() == [plain.t]


def test_an_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown linear method 'int3'; known: dense"):
        make_linear([torch.ones(2, 2)], method="int3")
