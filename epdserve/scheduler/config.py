"""`SchedulerConfig`: everything that shapes one scheduler, validated on construction.

Its `setting(...)` fields are the `epdserve scheduler` flags (epdserve/settings.py); `epdserve
launch` forwards the ones it offers by field (entrypoints/launch_settings.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.config import EngineConfig
from epdserve.limits import InputLimits
from epdserve.settings import check_settings, same_as, setting

ROUTINGS = ("cache-aware", "least-load")  # routing.POLICIES


@dataclass
class SchedulerConfig:
    """model: the checkpoint directory (only its tokenizer, image processor and config are loaded).

    Health hysteresis: an instance is SUSPECT after one failed probe/heartbeat, DOWN (no longer
    routed to) after `unhealthy_after` consecutive failures, and HEALTHY again after
    `healthy_after` consecutive good probes. DOWN instances are forgotten after `forget_after_s`.
    Backpressure: at most `max_requests_in_flight` public requests (`max_requests_per_tenant` of
    them from one tenant, when set), and at most
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
    `prefix_index_size`: prompt block digests remembered per instance, in its registered block
    size (prefix_index.py).
    """

    model: str = same_as(EngineConfig, "model",
                         help="checkpoint directory (only tokenizer/processor/config are loaded)")
    host: str = setting("127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 for all)")
    port: int = setting(0, check=(">=", 0), help="port to bind (default 0: a free port, printed when ready)")
    # instance health (health.py probes, registry.py's hysteresis)
    heartbeat_interval_s: float = setting(1.0, flag="--heartbeat-interval", check=(">", 0),
                                          help="heartbeat period told to instances at Register, seconds")
    probe_interval_s: float = setting(1.0, flag="--probe-interval", check=(">", 0),
                                      help="seconds between health probes")
    probe_timeout_s: float = setting(1.0, flag="--probe-timeout", check=(">", 0), help="a health probe's timeout, s")
    unhealthy_after: int = setting(3, check=(">=", 1), help="failed probes before an instance is dropped")
    healthy_after: int = setting(2, check=(">=", 1), help="good probes before a dropped instance rejoins")
    static_instances: list[str] = setting(
        default_factory=list, flag="--instance", action="append", metavar="HOST:PORT",
        help="a static instance to adopt (repeatable; adopted via GetLoad, then probed); instances may also register "
             "themselves")
    forget_after_s: float = 300.0  # a DOWN instance (registered or static) is dropped after this
    # admission and retries (dispatcher.py)
    max_requests_in_flight: int = setting(1024, flag="--max-requests", check=(">=", 1),
                                          help="requests in flight before RESOURCE_EXHAUSTED")
    max_inflight_per_instance: int = setting(
        256, check=(">=", 1), help="requests queued or running on one instance before it counts as full")
    max_requests_per_tenant: int | None = setting(
        None, check=(">=", 1), metavar="N",
        help="requests one tenant (an API key of --api-keys-file) may have in flight before RESOURCE_EXHAUSTED / "
             "HTTP 429 with Retry-After (default: only --max-requests)")
    max_sequences_per_tenant: int | None = setting(
        None, check=(">=", 1), metavar="N",
        help="sequences one tenant may have in flight, a request of n choices counting n, before RESOURCE_EXHAUSTED / "
             "HTTP 429; a request with n above it is refused at once (400) (unset: no bound)")
    max_tokens_per_tenant: int | None = setting(
        None, check=(">=", 1), metavar="N",
        help="tokens one tenant may have in flight: each request's prompt tokens (vision tokens included) plus n x its "
             "max_tokens, counted once the prompt is tokenized, before RESOURCE_EXHAUSTED / HTTP 429; a request "
             "above it alone is refused at once (400) (unset: no bound)")
    max_pixels_in_flight: int | None = setting(
        None, check=(">=", 1), metavar="N",
        help="pixels that the media of the requests in flight declare (images, and every frame of a video the "
             "decoder holds), counted from admission to each request's first token, before RESOURCE_EXHAUSTED; each "
             "costs ~14 bytes at the peak of its preprocessing (default 4 x --max-request-pixels: 400000000)")
    max_attempts: int = setting(4, check=(">=", 1), help="attempts per request across instance failures")
    retry_backoff_s: float = setting(0.05, check=(">=", 0), help="wait before attempt n+1 of a request: n times this")
    controller: object | None = None  # --mode auto: a scheduler.controller.ControllerConfig (None: no role controller)
    switch_wait_s: float = 60.0  # a request needing a role whose instances are all switching roles waits this long
    preprocess_threads: int = setting(4, check=(">=", 1), help="threads tokenising prompts and decoding images")
    media_index_size: int = setting(
        100_000, check=(">=", 1), help="media keys remembered so that clients may resend an image by key (LRU)")
    stored_keys_size: int = setting(100_000, check=(">=", 1),
                                    help="media keys remembered as already in the MM Store (LRU)")
    limits: InputLimits = field(default_factory=InputLimits)
    max_model_len: int | None = same_as(EngineConfig, "max_model_len")  # default: the model's (capped at 32768)
    mode: str = setting("", help="deployment mode name reported by GetServerInfo (as the launcher names it)")
    routing: str = setting(
        "cache-aware", choices=ROUTINGS,
        help="where a request prefills: cache-aware (default) = the coupled or P instance with the least "
             "outstanding work plus prompt tokens it would still have to prefill, counting the prefix this "
             "scheduler already sent it as cached; least-load = least outstanding work only")
    prefix_index_size: int = setting(
        131_072, check=(">=", 1), metavar="N",
        help="cache-aware routing: prompt block digests remembered per instance, in its registered block size (LRU)")
    upload_ttl_s: float = setting(3600.0, check=(">", 0),
                                  help="an uploaded file's life in seconds (/v1/files, UploadMedia; uploads.py); the "
                                       "MM Store's own TTL bounds its features, recomputed from the kept bytes")
    upload_max_bytes: int = setting(1 << 30, check=(">=", 1),
                                    help="uploaded bytes the scheduler keeps for recomputation, all tenants together")
    upload_tenant_max_bytes: int | None = setting(
        None, check=(">=", 1), metavar="BYTES",
        help="one tenant's share of the upload store (unset: the whole store); a tenant's upload evicts only its "
             "own files, least recently used first, and is refused (429) when the store is full of others'")
    upload_tenant_max_files: int | None = setting(
        None, check=(">=", 1), metavar="N", help="one tenant's uploaded files kept at once (unset: no bound; its "
                                                 "least recently used go first)")

    def __post_init__(self):
        if self.max_pixels_in_flight is None:
            self.max_pixels_in_flight = 4 * self.limits.max_request_pixels
        if not self.model:
            raise ValueError("model (a checkpoint directory) is required")
        check_settings(self)  # the bounds and choices declared on the fields
        if not 0 <= int(self.port) < 65536:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.forget_after_s <= 0:
            raise ValueError("forget_after_s must be > 0")
        if self.switch_wait_s < 0:
            raise ValueError("switch_wait_s must be >= 0")
        self.static_instances = list(self.static_instances)
