"""Engine counters and the time split reported by benchmarks: vision / prefill / decode, and
each step's host (Python) time apart from its forward.

A step's wall time (vision encoding aside) = host + forward. `forward_s` is the model runner's
`execute` less its input building: layers, LM head, sampling (on an accelerator, also the wait
for the device). `host_s` is the rest of `LLMEngine.step`: `schedule_s` (connector poll and
scheduling), `inputs_s` (packed inputs, positions, slots, block tables), `update_s` (appending
tokens, detokenizing, stop checks, making outputs). `decode_*` count the same for steps with
decode tokens only. `prefill_s` / `decode_s` keep their meaning: a step's `execute` time
(inputs + forward), by whether the step contained prompt tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineStats:
    vision_s: float = 0.0
    images_encoded: int = 0
    prefill_s: float = 0.0  # execute time of steps that contained prompt tokens (decodes riding along included)
    decode_s: float = 0.0  # execute time of steps with decode tokens only
    steps: int = 0
    prompt_tokens: int = 0
    decode_tokens: int = 0
    host_s: float = 0.0  # schedule_s + inputs_s + update_s
    schedule_s: float = 0.0
    inputs_s: float = 0.0
    update_s: float = 0.0
    forward_s: float = 0.0
    decode_steps: int = 0
    decode_host_s: float = 0.0
    decode_forward_s: float = 0.0

    def record_vision(self, n_images: int, seconds: float) -> None:
        self.images_encoded += n_images
        self.vision_s += seconds

    def record_step(self, batch, schedule_s: float, inputs_s: float, forward_s: float, update_s: float) -> None:
        """One step's batch and its times (seconds; see the module docstring)."""
        self.steps += 1
        prefill = sum(i.num_tokens for i in batch if i.num_tokens > 1 or i.start == 0)
        self.prompt_tokens += prefill
        self.decode_tokens += sum(1 for i in batch if i.num_tokens == 1 and i.start > 0)
        host = schedule_s + inputs_s + update_s
        self.host_s += host
        self.schedule_s += schedule_s
        self.inputs_s += inputs_s
        self.update_s += update_s
        self.forward_s += forward_s
        if prefill:
            self.prefill_s += inputs_s + forward_s
        else:
            self.decode_s += inputs_s + forward_s
            self.decode_steps += 1
            self.decode_host_s += host
            self.decode_forward_s += forward_s

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
