"""`SchedulerConfig`: everything that shapes one scheduler, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.limits import InputLimits


@dataclass
class SchedulerConfig:
    """model: the checkpoint directory (only its tokenizer, image processor and config are loaded).

    Health hysteresis: an instance is SUSPECT after one failed probe/heartbeat, DOWN (no longer
    routed to) after `unhealthy_after` consecutive failures, and HEALTHY again after
    `healthy_after` consecutive good probes. DOWN instances are forgotten after `forget_after_s`.
    Backpressure: at most `max_requests_in_flight` public requests, and at most
    `max_inflight_per_instance` of them on any one instance; beyond either, RESOURCE_EXHAUSTED.
    Pixels: at most `max_pixels_in_flight` declared pixels (`limits.check_generate_request`) of the
    requests whose media are still being decoded (`pixel_budget.PixelBudget`; default 4 x
    `limits.max_request_pixels`; what a pixel costs at the peak of preprocessing: docs/measurements.md);
    beyond, RESOURCE_EXHAUSTED.
    Bounds: `limits` (each request's input, checked before any work), `preprocess_threads`
    (tokenisation and image decode), `media_index_size` / `stored_keys_size` (media keys
    remembered), `max_attempts` (tries per request).
    Routing: `routing` "cache-aware" (default: the prefilling instance most likely to hold the
    prompt's longest prefix, weighed against load; routing.py) or "least-load";
    `prefix_index_size`: prompt chunk hashes remembered per instance (prefix_index.py).
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (the bound address is printed / returned)
    # instance health (health.py probes, registry.py's hysteresis)
    heartbeat_interval_s: float = 1.0  # told to instances at Register
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    unhealthy_after: int = 3
    healthy_after: int = 2
    static_instances: list[str] = field(default_factory=list)  # host:port of instances to adopt via GetLoad, then probe
    forget_after_s: float = 300.0  # a DOWN instance (registered or static) is dropped after this
    # admission and retries (dispatcher.py)
    max_requests_in_flight: int = 1024
    max_inflight_per_instance: int = 256
    max_pixels_in_flight: int | None = None  # None: 4 x limits.max_request_pixels
    max_attempts: int = 4  # per public request, across instance failures
    retry_backoff_s: float = 0.05  # before attempt n+1: n times this
    controller: object | None = None  # --mode auto: a scheduler.controller.ControllerConfig (None: no role controller)
    switch_wait_s: float = 60.0  # a request needing a role whose instances are all switching roles waits this long
    preprocess_threads: int = 4
    media_index_size: int = 100_000  # media keys a client may resend by key (LRU)
    stored_keys_size: int = 100_000  # media keys known to be in the MM Store (LRU)
    limits: InputLimits = field(default_factory=InputLimits)
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped at 32768)
    mode: str = ""  # as the launcher names it (reported by GetServerInfo)
    routing: str = "cache-aware"  # or "least-load" (routing.POLICIES)
    prefix_index_size: int = 131_072  # chunk hashes per instance (prefix_index.DEFAULT_CAPACITY)
    upload_ttl_s: float = 3600.0  # an uploaded file's life (uploads.py); the MM Store's own TTL bounds its features
    upload_max_bytes: int = 1 << 30  # uploaded bytes kept (LRU beyond)

    def __post_init__(self):
        if self.max_pixels_in_flight is None:
            self.max_pixels_in_flight = 4 * self.limits.max_request_pixels
        if not self.model:
            raise ValueError("model (a checkpoint directory) is required")
        if not 0 <= int(self.port) < 65536:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        for name in ("heartbeat_interval_s", "probe_interval_s", "probe_timeout_s", "forget_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("unhealthy_after", "healthy_after", "max_requests_in_flight", "max_inflight_per_instance",
                     "max_pixels_in_flight", "max_attempts", "preprocess_threads", "media_index_size",
                     "stored_keys_size", "prefix_index_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.routing not in ("cache-aware", "least-load"):
            raise ValueError(f"routing must be cache-aware or least-load, got {self.routing!r}")
        if self.upload_ttl_s <= 0 or self.upload_max_bytes < 1:
            raise ValueError("upload_ttl_s and upload_max_bytes must be > 0")
        if self.switch_wait_s < 0:
            raise ValueError("switch_wait_s must be >= 0")
        if self.retry_backoff_s < 0:
            raise ValueError("retry_backoff_s must be >= 0")
        self.static_instances = list(self.static_instances)
