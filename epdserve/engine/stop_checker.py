"""Stop criteria and incremental detokenization of one request's output."""
from __future__ import annotations

from epdserve.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def update(self, seq: Sequence) -> None:
        """Refresh seq.text after a new token and set seq.finish_reason if the request is done."""
        p = seq.params
        tok = seq.output_token_ids[-1]
        seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
        if p.stop:
            # search only the tail that can contain a new match
            tail_from = max(0, seq.emitted_text_len - max(len(s) for s in p.stop))
            hits = [i for i in (seq.text.find(s, tail_from) for s in p.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.finish_reason = "stop"
                return
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    @staticmethod
    def text_delta(seq: Sequence) -> str:
        """New text since the last call; holds back a trailing partial UTF-8 character while running."""
        text = seq.text
        if seq.finish_reason is None:
            while text.endswith("\ufffd"):
                text = text[:-1]
        if len(text) <= seq.emitted_text_len:
            return ""
        delta = text[seq.emitted_text_len :]
        seq.emitted_text_len = len(text)
        return delta
