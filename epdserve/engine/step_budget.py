"""`StepBudget`: how much prefill and encode one engine step may add beside its decodes.

A running decode waits for the whole step it is in, so a step's time is every decoding
request's inter-token gap. While anything decodes, a step is planned to fit `target_s` (a share
of the TPOT SLO): the decode batch first, then prefill tokens (chunked), then vision-tower
blocks, each sized from costs this engine measures online:

- LM step: seconds = a + b · tokens, least squares over the last `window` steps (decode-only
  steps pin `a`, steps with prefill chunks pin `b`);
- vision: seconds per (patch · block), a moving average over the blocks run so far.

Work-conserving: with nothing decoding there is no limit (prefill and encode at full size), and
while the costs are not yet known (fewer than two distinct step sizes measured) neither. Each
step still makes progress: at least `min_prefill_tokens` of prefill and one vision block.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

HEADROOM = 0.9  # plan to this share of the TPOT SLO: the costs are estimates


@dataclass(frozen=True)
class StepPlan:
    prefill_tokens: int | None  # None: no limit beyond max_num_batched_tokens
    vision_blocks: int | None  # None: run the encode whole


UNLIMITED = StepPlan(None, None)


class LinearCost:
    """seconds = a + b · x over a sliding window of measured (x, seconds)."""

    def __init__(self, window: int = 64):
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._fitted = False  # _fit is the current window's (a step plans twice, fits once)

    def add(self, x: float, seconds: float) -> None:
        self.samples.append((float(x), float(seconds)))
        self._fitted = False

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None while the window holds fewer than two distinct x."""
        if not self._fitted:
            self._fit, self._fitted = self._least_squares(), True
        return self._fit

    def _least_squares(self) -> tuple[float, float] | None:
        n = len(self.samples)
        if n < 2:
            return None
        mx = sum(x for x, _ in self.samples) / n
        my = sum(y for _, y in self.samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in self.samples)
        if sxx <= 1e-9:
            return None
        b = sum((x - mx) * (y - my) for x, y in self.samples) / sxx
        if b <= 0:  # noise: charge every token the mean cost instead
            return 0.0, my / max(mx, 1.0)
        return max(0.0, my - b * mx), b


class StepBudget:
    def __init__(self, slo_tpot_s: float, min_prefill_tokens: int = 16, window: int = 64):
        if slo_tpot_s <= 0:
            raise ValueError(f"the TPOT SLO must be > 0, got {slo_tpot_s}")
        self.target_s = slo_tpot_s * HEADROOM
        self.min_prefill_tokens = min_prefill_tokens
        self.lm = LinearCost(window)
        self.vision_s_per_patch_block: float | None = None

    # ---------------------------------------------------------------- measured
    def record_step(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.lm.add(tokens, seconds)

    def record_vision(self, patches: int, blocks: int, seconds: float) -> None:
        if patches <= 0 or blocks <= 0:
            return
        cost = seconds / (patches * blocks)
        old = self.vision_s_per_patch_block
        self.vision_s_per_patch_block = cost if old is None else 0.8 * old + 0.2 * cost

    # ---------------------------------------------------------------- planned
    def plan(self, decodes: int, prefill_wanted: int, vision_patches: int) -> StepPlan:
        """This step's prefill tokens and vision blocks beside `decodes` decoding requests;
        `prefill_wanted`: prefill tokens waiting, `vision_patches`: patches of the encode in
        flight (0: none)."""
        fit = self.lm.fit()
        if decodes == 0 or fit is None:
            return UNLIMITED
        a, b = fit
        left = self.target_s - (a + b * decodes)
        prefill = max(self.min_prefill_tokens, int(max(left, 0.0) / b)) if b > 0 else None
        if prefill is not None and prefill_wanted:
            left -= b * min(prefill, prefill_wanted)
        blocks = None
        if vision_patches:  # one block to learn its cost, then what fits
            cost = self.vision_s_per_patch_block
            blocks = 1 if cost is None else max(1, int(max(left, 0.0) / (cost * vision_patches)))
        return StepPlan(prefill, blocks)
