"""Stop criteria and incremental detokenization of one request's output.

`update(seq)` runs once per new token and costs the same at output token 10 and 10,000: it
decodes only a short window of the newest tokens (vLLM's prefix / read offsets, state in the
`Sequence`'s `detok` state) and searches for stop strings only where the text changed.

Invariant: `seq.text == tokenizer.decode(seq.output_token_ids, skip_special_tokens=...)`, cut at
the first stop string once one is found. It holds because a window starts at a clean boundary:
`output_token_ids[:detok.read_offset]` decodes to text that does not end in U+FFFD (no partial
UTF-8 character), so what follows decodes the same alone as after it. A window whose text ends
in U+FFFD is not committed; the next token decodes it again, with the bytes that complete it.
The window also keeps the tokens before `detok.read_offset` (from `detok.prefix_offset`) and
takes only the text past theirs, so decoders that treat a first token specially (SentencePiece's
leading space) give the same text as a whole decode.
"""
from __future__ import annotations

from epdserve.engine.sequence import Sequence

_REPLACEMENT = "\ufffd"  # what a decoder makes of a partial UTF-8 character


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._decode = _plain_decode(tokenizer)

    def update(self, seq: Sequence) -> None:
        """Refresh seq.text after new token(s) and set seq.finish_reason if the request is done."""
        p = seq.params
        tok = seq.output_token_ids[-1]
        final_len = seq.emitted.detok.text_len  # text before this was final and searched in earlier updates
        self._detokenize(seq)
        if p.stop:
            # a new match ends past final_len, so it starts at most len(stop) - 1 characters before
            start = max(0, final_len - max(len(s) for s in p.stop) + 1)
            hits = [i for i in (seq.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.finish_reason = "stop"
                return
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _detokenize(self, seq: Sequence) -> None:
        ids, skip = seq.output_token_ids, seq.params.skip_special_tokens
        start, read = seq.emitted.detok.prefix_offset, seq.emitted.detok.read_offset
        prefix = self._decode(ids[start:read], skip) if read > start else ""
        window = self._decode(ids[start:], skip)
        text, seq.text = seq.text, ""  # drop the Sequence's reference: with ours the only one, += grows in place
        if len(text) != seq.emitted.detok.text_len:
            text = text[: seq.emitted.detok.text_len]  # the last step's uncommitted tail goes
        text += window[len(prefix) :]  # CPython appends in place to a str nobody else holds: O(new), not O(text)
        seq.text = text
        if len(window) > len(prefix) and not window.endswith(_REPLACEMENT):
            seq.emitted.detok.text_len = len(seq.text)
            seq.emitted.detok.prefix_offset, seq.emitted.detok.read_offset = read, len(ids)

    @staticmethod
    def text_delta(seq: Sequence) -> str:
        """New text since the last call; holds back a trailing partial UTF-8 character while running."""
        text, end = seq.text, len(seq.text)
        if seq.finish_reason is None:
            while end > seq.emitted.text_len and text[end - 1] == _REPLACEMENT:
                end -= 1
        if end <= seq.emitted.text_len:
            return ""
        delta = text[seq.emitted.text_len : end]
        seq.emitted.text_len = end
        return delta


def _plain_decode(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=skip)` as a function of (ids, skip).

    A transformers fast tokenizer's `decode` checks its argument in Python on every call, which a
    step pays twice per request (docs/measurements.md); its Rust backend gives the same text when
    transformers would not clean up spaces afterwards.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
