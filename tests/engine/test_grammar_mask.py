"""The grammar mask (engine/grammar.py TokenMasker): xgrammar's CPU kernel and the plain torch
ops that NPU and other devices use give the same masked logits, row for row — live matchers,
a terminated one (stop tokens only), rows without a grammar untouched — and the preallocated
bitmask is reused and grown, never stale, across steps of different batch sizes."""
import json

import pytest
import torch

from epdserve import LLM
from epdserve.engine.grammar import TokenMasker, mask_logits
from epdserve.engine.structured_output import StructuredOutput


@pytest.fixture(scope="module")
def engine(qwen2_vl_tiny):
    return LLM(model=qwen2_vl_tiny, device="cpu").engine


def _states(engine):
    """(row, state, output tokens) for three grammars, one of them already terminated."""
    g = engine.grammars
    tok = engine.tokenizer
    choice = g.matcher(StructuredOutput.choice(["yes", "no"]))
    done = g.matcher(StructuredOutput.choice(["yes"]))
    done_out = tok.encode("yes", add_special_tokens=False) + [min(engine.model.eos_token_ids)]
    schema_c = StructuredOutput("json", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    schema_out = []
    for _ in range(4):  # a few tokens in: the largest token the grammar allows each time
        schema_out.append(max(_allowed(g.matcher(schema_c), schema_out, g.vocab_size)))
    schema = g.matcher(schema_c)
    return [(0, choice, []), (2, done, done_out), (3, schema, schema_out)]


def _allowed(state, out, vocab):
    """The reference: the grammar's allowed set, one matcher and one row at a time."""
    import xgrammar as xgr

    state.sync(out)
    if state.matcher.is_terminated():
        return set(state.matcher.stop_token_ids)
    bm = xgr.allocate_token_bitmask(1, vocab)
    state.matcher.fill_next_token_bitmask(bm)
    return {t for t in range(vocab) if (int(bm[0, t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_each_backend_keeps_exactly_the_allowed_tokens(engine, backend):
    vocab = engine.grammars.vocab_size
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = _states(engine)
    TokenMasker(vocab, "cpu", rows=2, backend=backend)(logits, rows)  # 2 < 5 rows: the bitmask grows
    reference = _states(engine)
    for r, state, out in reference:
        allowed = _allowed(state, out, vocab)
        kept = set(torch.nonzero(logits[r] != float("-inf")).flatten().tolist())
        assert kept == allowed and allowed, f"row {r}"
        assert torch.equal(logits[r, sorted(allowed)], before[r, sorted(allowed)])
    for r in (1, 4):  # no grammar
        assert torch.equal(logits[r], before[r])


def test_cpu_kernel_and_plain_ops_agree_over_steps(engine):
    vocab = engine.grammars.vocab_size
    a, b = TokenMasker(vocab, "cpu", rows=4, backend="cpu"), TokenMasker(vocab, "cpu", rows=4, backend="torch_native")
    sa, sb = _states(engine), _states(engine)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        logits = torch.randn(4 + step % 2, vocab, generator=gen)
        la, lb = logits.clone(), logits.clone()
        a(la, sa)
        b(lb, sb)
        assert torch.equal(la, lb), f"step {step}"
        for (r, _, out), (_, _, out_b) in zip(sa, sb):  # both go on with the same greedy token
            t = int(la[r].argmax())
            out.append(t)
            out_b.append(t)
    ref = torch.randn(4, vocab, generator=gen)
    via_function = ref.clone()
    mask_logits(via_function, _states(engine))
    TokenMasker(vocab, "cpu")(ref, _states(engine))
    assert torch.equal(ref, via_function)


def test_every_row_constrained_takes_the_same_mask(engine):
    """All rows constrained (no index list handed to xgrammar) masks as a partial batch does."""
    vocab = engine.grammars.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    packed = logits[[0, 2, 3]].clone()
    TokenMasker(vocab, "cpu")(logits, _states(engine))
    for backend in ("cpu", "torch_native"):
        got = packed.clone()
        TokenMasker(vocab, "cpu", backend=backend)(got, [(i, s, o) for i, (_, s, o) in enumerate(_states(engine))])
        assert torch.equal(got, logits[[0, 2, 3]]), backend
