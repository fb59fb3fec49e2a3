"""`EngineConfig`: everything that shapes one engine, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.engine.roles import normalize_roles


@dataclass
class EngineConfig:
    """roles: which stages this engine runs ("EPD" = the whole pipeline in one step loop)."""

    model: str
    device: str = "auto"
    dtype: str = "auto"  # fp32 on CPU, bf16 elsewhere
    roles: str = "EPD"
    block_size: int | None = None  # None: the platform's kv_block_size (set by the engine)
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    # vision tokens (after the spatial merge) E encodes per engine step, across requests; a video
    # over the budget is encoded a few temporal patches per step (engine/encode_plan.py)
    encode_token_budget: int = 1024
    enable_chunked_prefill: bool = True
    feature_wait_s: float = 0.0  # bounded wait for a feature before recomputing it
    seed: int = 0
    ops: str | None = None  # paged operators: native | portable; None: $EPDSERVE_OPS, else the platform's best

    def __post_init__(self):
        self.roles = normalize_roles(self.roles)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "encode_token_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto|float32|float16|bfloat16, got {self.dtype!r}")
        if self.ops not in (None, "native", "portable"):
            raise ValueError(f"ops must be native|portable, got {self.ops!r}")

    @property
    def encodes(self) -> bool:
        return "E" in self.roles

    @property
    def prefills(self) -> bool:
        return "P" in self.roles

    @property
    def decodes(self) -> bool:
        return "D" in self.roles

    @property
    def computes(self) -> bool:
        """Runs the language model (P or D): holds request KV, schedules tokens."""
        return self.prefills or self.decodes
