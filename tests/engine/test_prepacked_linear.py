"""The CPU's prepacked dense projection (engine/lm/prepacked_linear.py): it is what "dense" builds
on the CPU where oneDNN runs the dtype, it equals `F.linear` on the fused parts within fp32
rounding (contiguous or strided inputs, any row count), it reports "dense", and a dtype oneDNN
cannot run here stays `DenseLinear` (bit for bit transformers' `F.linear` route)."""
from __future__ import annotations

import pytest
import torch

from epdserve.engine.lm import prepacked_linear
from epdserve.engine.lm.linear import DenseLinear, make_linear, method_of
from epdserve.engine.lm.prepacked_linear import PrepackedLinear


def _parts(gen):
    parts = [torch.randn(n, 64, generator=gen) * 0.1 for n in (48, 16, 16)]
    biases = [torch.randn(48, generator=gen), None, torch.randn(16, generator=gen)]
    return parts, biases


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_prepacked_equals_the_parts_applied_alone(rows):
    gen = torch.Generator().manual_seed(rows)
    parts, biases = _parts(gen)
    lin = make_linear(parts, biases)
    assert isinstance(lin, PrepackedLinear) and method_of(lin) == "dense" and lin.out_features == 80
    wide = torch.randn(rows, 128, generator=gen)
    for x in (wide[:, :64].contiguous(), wide[:, 64:]):  # contiguous, then a strided view
        want = torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(parts, biases)], dim=1)
        assert torch.allclose(lin(x), want, rtol=0, atol=4e-6)
    assert len(lin.tensors()) == 2 and lin.tensors()[0].is_mkldnn


def test_a_dtype_onednn_cannot_run_stays_dense(monkeypatch):
    monkeypatch.setattr(prepacked_linear.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    gen = torch.Generator().manual_seed(0)
    parts = [p.bfloat16() for p in _parts(gen)[0]]
    lin = make_linear(parts)
    assert isinstance(lin, DenseLinear)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    assert torch.equal(lin(x), torch.nn.functional.linear(x, torch.cat(parts)))


def test_off_the_cpu_or_in_another_method_nothing_is_prepacked():
    assert not prepacked_linear.usable(torch.float32, "cuda")
    assert not prepacked_linear.usable(torch.int8)
    lin = make_linear([torch.randn(16, 64)], method="int8")
    assert method_of(lin) == "int8"


def test_an_untied_lm_head_is_prepacked_and_a_tied_one_stays_the_embeddings_own():
    from types import SimpleNamespace

    from epdserve.engine.lm.forward import _head

    gen = torch.Generator().manual_seed(1)
    embed = torch.nn.Embedding(100, 32)
    head = torch.nn.Linear(32, 100, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(100, 32, generator=gen))
        head.weight.copy_(torch.randn(100, 32, generator=gen))
    x = torch.randn(3, 32, generator=gen)
    want = torch.nn.functional.linear(x, head.weight.detach().clone())
    untied = _head(SimpleNamespace(lm_head=head, embed=embed), "cpu")
    assert isinstance(untied, PrepackedLinear) and torch.allclose(untied(x), want, rtol=0, atol=1e-5)
    assert head.weight.numel() == 0  # the row-major copy is released: one copy of the head
    tied_head = torch.nn.Linear(32, 100, bias=False)
    tied_head.weight = embed.weight
    tied = _head(SimpleNamespace(lm_head=tied_head, embed=embed), "cpu")
    assert isinstance(tied, DenseLinear) and tied.t.data_ptr() == embed.weight.data_ptr()
    assert torch.equal(tied(x), x @ embed.weight.detach().t())
