"""What many test files share, declared once: waiting for a state (`wait_until`) and the Qwen-VL
image placeholder of a prompt (`PH`). Deployments shared across files are session fixtures in
`tests/conftest.py`; a package's own harness (`tests/instance/harness.py`, ...) builds on this."""
from __future__ import annotations

import time
from typing import Callable

# one image in a Qwen2-VL / Qwen2.5-VL / Qwen3-VL prompt: the processor expands it to the image's tokens
PH = "<|vision_start|><|image_pad|><|vision_end|>"


def wait_until(predicate: Callable[[], object], timeout_s: float = 30.0, what: str = "condition",
               interval_s: float = 0.02, detail: Callable[[], str] | None = None):
    """Poll `predicate` until it returns a truthy value (returned), or raise AssertionError naming
    `what` (and `detail()`, e.g. the logs of the processes involved) after `timeout_s`. For a state
    another thread or process owns, with nothing to block on."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}"
                                 + (f"\n{detail()}" if detail else ""))
        time.sleep(interval_s)  # polling state owned elsewhere; nothing to block on
