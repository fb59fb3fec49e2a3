"""`StepBudget`: how much prefill and encode one engine step may add beside its decodes.

A running decode waits for the whole step it is in, so a step's time is every decoding
request's inter-token gap. While anything decodes, a step is planned to fit `target_s` (a share
of the TPOT SLO): the decode batch first, then prefill tokens (chunked), then vision-tower
blocks, each sized from costs this engine measures online:

- LM step: seconds = a + b · tokens, least squares over the last `window` steps (decode-only
  steps pin `a`, steps with prefill chunks pin `b`);
- vision: seconds per (patch · block), a moving average over the blocks run so far.

The step's time is each decoding request's slack, not a fixed share: a request's next token is
due `target_s` (HEADROOM × the SLO) after its previous one was due, counted from when it started
decoding here, so a request whose steps ran short (decode-only) has banked time a later step may
spend, and one whose steps overran (an estimate that was low) gets shorter steps until it is back
on schedule. The TPOT SLO is a mean over a request's tokens, so its slack is counted over its next
`horizon` H tokens (`--step-budget-horizon`, HORIZON = 32 by default; its remaining tokens if
fewer): the step may take what keeps its token n + H on time if the H - 1 steps after it decode
only (at the measured decode-only cost). The step may take the least slack of its decoding
requests, at most `bank` targets (`--step-budget-bank`, BANK = 32 by default: no cap below what a
full horizon can bank). So slack is spent only when work waits, and then at once: a lightly
loaded engine runs an arriving image's encode and prefill whole (one long gap in its decodes,
their other gaps at the decode's own cost), and slices it only where its decodes cannot afford
it (a burst: every request's mean kept to the target).

Chosen by measurement (issue 50, this CPU, fp32, docs/benchmarks.md "Against vLLM"): the former
defaults, horizon 1 and bank 2, kept every gap near the target, so under a steady concurrency of 4
image requests (aiperf against the served small model, one run of 2 rounds) each waiting encode
was spread over steps stretched to ~0.9 x the SLO: inter-token latency p50 72.6-73.2 ms against
26.4-27.7 ms for these defaults (no budget: 24.6-27.0), output tok/s 33.1-35.9 against 41.7-41.8;
TTFT p50 was lower (1.45-1.90 s against 2.49-2.54 s; the TPOT means alike in one process,
benchmarks/budget_policy.py). In a burst these
keep every request's TPOT under the SLO as the former did (no budget does not), at half the former's
TPOT p50. Horizon 32 with bank 2 (a step capped at 2 targets) starved a burst's prompts (TTFT p50
3-5x) and stays a measured non-default.

Which of prefill and encode goes first in the step: the older request (arrival order), so an
image's encode is not starved by prompts that arrived after it.

Work-conserving: with nothing decoding there is no limit (prefill and encode at full size), and
while the costs are not yet known (fewer than two distinct step sizes measured) neither. Progress:
a step may add no prefill and no vision block while the decodes bank slack for one (a vision
block can cost more than a whole target); once the bank is full, or the decodes alone take the
target, a step adds at least `min_prefill_tokens` of prefill and one vision block.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

HEADROOM = 0.9  # plan to this share of the TPOT SLO: the costs are estimates
HORIZON = 32  # by default a request's slack is counted over its next 32 tokens (see above)
BANK = 32.0  # by default a step takes at most this many targets (a full horizon's slack: no lower cap)


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
    def __init__(self, slo_tpot_s: float, min_prefill_tokens: int = 16, window: int = 64, bank: float = BANK,
                 horizon: int = HORIZON):
        if slo_tpot_s <= 0:
            raise ValueError(f"the TPOT SLO must be > 0, got {slo_tpot_s}")
        if bank < 1:
            raise ValueError(f"the step budget's bank must be >= 1 target, got {bank}")
        self.target_s = slo_tpot_s * HEADROOM
        self.max_step_s = self.target_s * bank
        self.horizon = horizon
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
    def step_target(self, clocks: list[tuple[float, int] | tuple[float, int, int]], now: float,
                    decode_s: float | None = None) -> float:
        """Seconds this step may take beside decodes whose clocks are (when the request started
        decoding here, tokens it has made since[, tokens it may still make]): the least slack, at most
        `max_step_s` (with nothing decoding: `target_s`). A request's slack is to its next token's due
        time, plus, given `decode_s` (a decode-only step's cost) and its tokens to come, what the next
        `horizon` - 1 decode-only steps would save against the target. Negative when one is late."""
        def slack(clock) -> float:
            own = clock[0] + (clock[1] + 1) * self.target_s - now
            if decode_s is None or len(clock) < 3:
                return own
            ahead = min(self.horizon, clock[2]) - 1
            return own + max(ahead, 0) * max(self.target_s - decode_s, 0.0)

        return min(min((slack(c) for c in clocks), default=self.target_s), self.max_step_s)

    def decode_cost(self, decodes: int) -> float | None:
        """Seconds a step of `decodes` decode rows alone takes (None while the costs are unknown)."""
        fit = self.lm.fit()
        return None if fit is None else fit[0] + fit[1] * decodes

    def plan(self, decodes: int, prefill_wanted: int, vision_patches: int, target_s: float | None = None,
             vision_first: bool = False) -> StepPlan:
        """This step's prefill tokens and vision blocks beside `decodes` decoding requests within
        `target_s` seconds (default: the SLO's share); `prefill_wanted`: prefill tokens waiting,
        `vision_patches`: patches of the encode in flight (0: none); `vision_first`: the encode
        takes its blocks before the prefill takes its tokens."""
        fit = self.lm.fit()
        if decodes == 0 or fit is None:
            return UNLIMITED
        a, b = fit[0], max(fit[1], 1e-9)
        target = self.target_s if target_s is None else target_s
        left = target - (a + b * decodes)
        # progress: nothing needs to fit while decode-only steps bank slack for it; at least the
        # minimum once they cannot (the decodes alone take the target, or the bank is full)
        must = a + b * decodes >= self.target_s or target >= self.max_step_s
        blocks = None
        if vision_first and vision_patches:
            blocks, left = self._vision(left, vision_patches, must)
        prefill = max(self.min_prefill_tokens if must else 0, int(max(left, 0.0) / b))
        if prefill_wanted:
            left -= b * min(prefill, prefill_wanted)
        if vision_patches and not vision_first:
            blocks, left = self._vision(left, vision_patches, must)
        return StepPlan(prefill, blocks)

    def _vision(self, left: float, patches: int, must: bool) -> tuple[int, float]:
        """Vision blocks that fit `left` seconds (one to learn the cost; one if `must`), and the
        time left after."""
        cost = self.vision_s_per_patch_block
        if cost is None:
            return 1, left
        blocks = max(1 if must else 0, int(max(left, 0.0) / (cost * patches)))
        return blocks, left - blocks * cost * patches

