"""Incremental detokenization and stop checks (`StopChecker`) against whole-output decoding.

The reference is what the engine did before decoding incrementally: after every token, decode
the whole output with the demo tokenizer, cut at the first stop string. Token sequences mix
single bytes (so multi-byte characters split across tokens, and invalid UTF-8), whole
characters, ordinary words and special tokens.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from epdserve.engine.outputs import OutputTokens, make_output
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import RequestState, Sequence
from epdserve.engine.stop_checker import StopChecker

MULTIBYTE = "é€😀中文ß→ﬁ\ufffd"


@pytest.fixture(scope="module")
def tok(qwen2_vl_tiny):
    return AutoTokenizer.from_pretrained(qwen2_vl_tiny)


@pytest.fixture(scope="module")
def pools(tok):
    """Token id pools: bytes of multi-byte characters, whole words, specials, anything."""
    return {
        "bytes": sorted(set(tok.encode(MULTIBYTE, add_special_tokens=False))),
        "words": tok.encode(" the cat sees a red car, again and again.\n", add_special_tokens=False),
        "special": list(tok.all_special_ids),
        "any": list(range(len(tok))),
    }


def token_lists(pools, max_size=60):
    pick = st.sampled_from(["bytes", "words", "special", "any"])
    return st.lists(pick.flatmap(lambda k: st.sampled_from(pools[k])), min_size=1, max_size=max_size)


def reference(tok, ids, params, eos):
    """Whole-output decode after every token (the old StopChecker): texts, deltas, finish step."""
    texts, deltas, emitted = [], [], 0
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=params.skip_special_tokens)
        hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
        reason = None
        if hits:
            text, reason = text[: min(hits)], "stop"
        elif (not params.ignore_eos and ids[k - 1] in eos) or ids[k - 1] in params.stop_token_ids:
            reason = "stop"
        elif k >= params.max_tokens:
            reason = "length"
        shown = text if reason else text.rstrip("\ufffd")
        deltas.append(shown[emitted:] if len(shown) > emitted else "")
        emitted = max(emitted, len(shown))
        texts.append(text)
        if reason:
            return texts, deltas, reason
    return texts, deltas, None


def incremental(tok, ids, params, eos):
    checker = StopChecker(tok, eos, max_model_len=1 << 20)
    seq = Sequence("r", [1, 2, 3], params, state=RequestState.RUNNING)
    texts, deltas = [], []
    for t in ids:
        seq.output_token_ids.append(t)
        checker.update(seq)
        texts.append(seq.text)
        deltas.append(StopChecker.text_delta(seq))
        if seq.finish_reason:
            break
    return texts, deltas, seq.finish_reason


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_equals_whole_decode_after_every_token(tok, pools, data):
    ids = data.draw(token_lists(pools))
    skip = data.draw(st.booleans())
    full = tok.decode(ids, skip_special_tokens=skip)
    stop = data.draw(st.lists(st.one_of(
        st.integers(0, max(0, len(full) - 1)).flatmap(lambda i: st.integers(1, 4).map(lambda n: full[i : i + n])),
        st.text(alphabet="abc " + MULTIBYTE, min_size=1, max_size=3),
    ).filter(bool), max_size=3))
    params = SamplingParams(max_tokens=data.draw(st.integers(1, len(ids) + 1)), stop=stop,
                            stop_token_ids=data.draw(st.lists(st.sampled_from(ids), max_size=1)),
                            ignore_eos=data.draw(st.booleans()), skip_special_tokens=skip)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    assert incremental(tok, ids, params, eos) == reference(tok, ids, params, eos)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_long_outputs_without_stops_match_whole_decode(tok, pools, data):
    ids = data.draw(token_lists(pools, max_size=400))
    skip = data.draw(st.booleans())
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=skip)
    texts, deltas, reason = incremental(tok, ids, params, set())
    assert reason == "length" and texts[-1] == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == texts[-1]


def test_each_update_decodes_a_short_window(tok, pools):
    """The work per token does not grow with the output: every decode call sees a few tokens."""
    sizes = []
    checker = StopChecker(tok, set(), max_model_len=1 << 20)
    inner = checker._decode
    checker._decode = lambda ids, skip: sizes.append(len(ids)) or inner(ids, skip)
    seq = Sequence("r", [1], SamplingParams(max_tokens=5000, ignore_eos=True, stop=["never there"]),
                   state=RequestState.RUNNING)
    text = (" the cat sees é€ 😀 a red car" * 200).encode()
    ids = tok.encode(text.decode(), add_special_tokens=False)[:3000]
    for t in ids:
        seq.output_token_ids.append(t)
        checker.update(seq)
    assert seq.text == tok.decode(ids, skip_special_tokens=True)
    assert max(sizes) <= 8


def test_decode_side_first_token_then_more(tok):
    """A decode-side request starts with the prefill side's first token; the detokenizer starts there too."""
    checker = StopChecker(tok, set(), max_model_len=1 << 20)
    ids = tok.encode(" hello 😀 world", add_special_tokens=False)
    seq = Sequence("r", [1], SamplingParams(max_tokens=50, ignore_eos=True), state=RequestState.RUNNING)
    seq.output_token_ids = [ids[0]]
    checker.update(seq)
    for t in ids[1:]:
        seq.output_token_ids.append(t)
        checker.update(seq)
    assert seq.text == " hello 😀 world"


def test_outputs_view_tokens_while_running_and_copy_once_done(tok):
    seq = Sequence("r", [1], SamplingParams(max_tokens=5, ignore_eos=True), state=RequestState.RUNNING)
    seq.output_token_ids.extend([5, 6, 7])
    out = make_output(seq)
    assert isinstance(out.token_ids, OutputTokens) and out.new_token_ids == [5, 6, 7]
    seq.output_token_ids.append(8)  # later tokens do not show in an earlier output
    assert out.token_ids == [5, 6, 7] and list(out.token_ids) == [5, 6, 7] and len(out.token_ids) == 3
    assert out.token_ids[0] == 5 and out.token_ids[-1] == 7 and out.token_ids[1:] == [6, 7]
    assert 8 not in out.token_ids and out.token_ids != [5, 6, 7, 8] and repr(out.token_ids) == "[5, 6, 7]"
    with pytest.raises(IndexError):
        out.token_ids[3]
    seq.state = RequestState.FINISHED
    final = make_output(seq)
    assert type(final.token_ids) is list and final.token_ids == [5, 6, 7, 8] and final.new_token_ids == [8]
