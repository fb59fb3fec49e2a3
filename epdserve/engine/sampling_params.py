"""`SamplingParams`: how one request samples and when it stops (validated on construction)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from epdserve.engine.structured_output import StructuredOutput

MIN_TEMPERATURE = 1e-5  # below it (but not 0), logits / temperature overflow float32 to inf
MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's bound


@dataclass
class SamplingParams:
    """Sampling and stop criteria of one request, in vLLM's shape.

    temperature 0 means greedy. top_k <= 0, top_p == 1 and min_p == 0 disable those filters.
    min_p (vLLM's): tokens whose probability is below min_p times the most likely token's are
    dropped before sampling (greedy is unaffected). `seed` makes a sampled request reproducible
    regardless of what it is batched with.

    Logits processors (engine/logits_process.py, vLLM v1's order: logit_bias, then repetition,
    then frequency and presence), applied before temperature and the filters, so they change
    greedy output too: `logit_bias` {token id: added to its logit}; `repetition_penalty` (1 off)
    divides a positive logit (multiplies a negative one) of every token in the prompt or the
    output; `frequency_penalty` subtracts penalty x count of the token in the output, and
    `presence_penalty` subtracts penalty once if it is there. `resumed_outputs`: the last tokens of
    the prompt are this request's own output (a request resumed or retried after them): the
    penalties count them as output. `logprobs` (None: off) asks for the sampled token's log
    probability and that many top alternatives (engine/logprobs.py). `structured`: the grammar the output must follow
    (engine/grammar.py masks every sampled token with it, greedy included, after the logits
    processors), or None. `n`: how many choices (OpenAI's `n`): the prompt is prefilled once and
    the choices fork at the first token, choice j sampling with seed + j (engine/sequence_group.py).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    structured: StructuredOutput | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    resumed_outputs: int = 0
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 turns it off), got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 turns it off), "
                             f"got {self.repetition_penalty}")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.resumed_outputs < 0:
            raise ValueError(f"resumed_outputs must be >= 0, got {self.resumed_outputs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Some logits processor (bias or penalty) changes this request's logits."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty)
