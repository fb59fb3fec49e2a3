"""`PixelBudget`: the pixels of the requests whose media are still being decoded, scheduler-wide.

A request's pixels (what its media's headers declare: `limits.check_generate_request`) are taken
when the dispatcher admits it, before anything is decoded, and given back when its media are
done with: its first output token (the scheduler decoded them, the encoding and prefilling
instances read them) or its end, whichever comes first — finished, failed, aborted or cancelled.
A request that does not fit beside those in flight is RESOURCE_EXHAUSTED (a retry may fit); one
larger than the whole budget is INVALID_ARGUMENT (it never fits). Used on the scheduler's event
loop only (no lock).
"""
from __future__ import annotations

from epdserve.scheduler.errors import RequestError


class PixelBudget:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0

    def take(self, pixels: int) -> PixelLease:
        """Admit `pixels` or raise RequestError; the lease gives them back (once)."""
        if pixels > self.capacity:
            raise RequestError.invalid(
                f"the request's media declare {pixels} pixels, more than the scheduler's whole budget of "
                f"{self.capacity} pixels in flight; send fewer or smaller media, or raise its --max-pixels-in-flight")
        if self.used + pixels > self.capacity:
            raise RequestError.exhausted(
                f"pixel budget in flight is full: {self.used} of {self.capacity} pixels are being decoded for "
                f"other requests and this one declares {pixels}; retry later (scheduler flag --max-pixels-in-flight)")
        self.used += pixels
        return PixelLease(self, pixels)


class PixelLease:
    def __init__(self, budget: PixelBudget, pixels: int):
        self._budget = budget
        self.pixels = pixels

    def release(self) -> None:
        """Give the pixels back; later calls do nothing."""
        self._budget.used -= self.pixels
        self.pixels = 0
