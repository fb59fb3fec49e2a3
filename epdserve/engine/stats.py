"""Engine counters and the time split (vision / prefill / decode) reported by benchmarks."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    vision_s: float = 0.0
    images_encoded: int = 0
    prefill_s: float = 0.0  # steps that contained prompt tokens (decodes riding along included)
    decode_s: float = 0.0  # steps with decode tokens only
    steps: int = 0
    prompt_tokens: int = 0
    decode_tokens: int = 0

    def record_vision(self, n_images: int, seconds: float) -> None:
        self.images_encoded += n_images
        self.vision_s += seconds

    def record_step(self, batch, seconds: float) -> None:
        self.steps += 1
        prefill = sum(i.num_tokens for i in batch if i.num_tokens > 1 or i.start == 0)
        self.prompt_tokens += prefill
        self.decode_tokens += sum(1 for i in batch if i.num_tokens == 1 and i.start > 0)
        if prefill:
            self.prefill_s += seconds
        else:
            self.decode_s += seconds

    def as_dict(self) -> dict:
        return dict(self.__dict__)
