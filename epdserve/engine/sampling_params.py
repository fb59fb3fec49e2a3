"""`SamplingParams`: how one request samples and when it stops (validated on construction)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from epdserve.engine.structured_output import StructuredOutput

MIN_TEMPERATURE = 1e-5  # below it (but not 0), logits / temperature overflow float32 to inf


@dataclass
class SamplingParams:
    """Sampling and stop criteria of one request, in vLLM's shape.

    temperature 0 means greedy. top_k <= 0, top_p == 1 and min_p == 0 disable those filters.
    min_p (vLLM's): tokens whose probability is below min_p times the most likely token's are
    dropped before sampling (greedy is unaffected). `seed` makes a sampled request reproducible
    regardless of what it is batched with. `structured`: the grammar the output must follow
    (engine/grammar.py masks every sampled token with it, greedy included), or None.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
