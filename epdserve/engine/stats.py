"""Engine counters and the time split reported by benchmarks: vision / prefill / decode, and
each step's host (Python) time apart from its forward.

A step's wall time (vision encoding aside) = host + forward. `forward_s` is the model runner's
`execute` less its input building: layers, LM head, sampling (on an accelerator, also the wait
for the device). `host_s` is the rest of `LLMEngine.step`: `schedule_s` (connector poll and
scheduling), `inputs_s` (packed inputs, positions, slots, block tables), `update_s` (appending
tokens, detokenizing, stop checks, making outputs). `decode_*` count the same for steps with
decode tokens only. `prefill_s` / `decode_s` keep their meaning: a step's `execute` time
(inputs + forward), by whether the step contained prompt tokens. An instance reports `steps`,
`host_s + forward_s` and `batch_requests` in its `Load` (the scheduler's /metrics exports them).
"""
from __future__ import annotations

COUNTERS = (
    "vision_s", "images_encoded", "prefill_s", "decode_s", "steps", "prompt_tokens", "decode_tokens",  # vision, by step kind
    "host_s", "schedule_s", "inputs_s", "update_s", "forward_s",  # every step's host parts and forward
    "decode_steps", "decode_host_s", "decode_forward_s",  # the same for decode-only steps
    "batch_requests",  # requests in each step's batch, summed (/ steps: the mean batch size)
)


class EngineStats:
    """Running totals, read as one dict (`as_dict`); benchmarks subtract two readings."""

    def __init__(self):
        self._t: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def record_vision(self, n_images: int, seconds: float) -> None:
        self._t["images_encoded"] += n_images
        self._t["vision_s"] += seconds

    def record_step(self, batch, schedule_s: float, inputs_s: float, forward_s: float, update_s: float) -> None:
        """One step's batch and its times (seconds; see the module docstring)."""
        t = self._t
        t["steps"] += 1
        t["batch_requests"] += len(batch)
        prefill = sum(i.num_tokens for i in batch if i.num_tokens > 1 or i.start == 0)
        t["prompt_tokens"] += prefill
        t["decode_tokens"] += sum(1 for i in batch if i.num_tokens == 1 and i.start > 0)
        host = schedule_s + inputs_s + update_s
        for name, v in (("host_s", host), ("schedule_s", schedule_s), ("inputs_s", inputs_s), ("update_s", update_s),
                        ("forward_s", forward_s)):
            t[name] += v
        if prefill:
            t["prefill_s"] += inputs_s + forward_s
        else:
            t["decode_s"] += inputs_s + forward_s
            t["decode_steps"] += 1
            t["decode_host_s"] += host
            t["decode_forward_s"] += forward_s

    def as_dict(self) -> dict:
        return dict(self._t)
