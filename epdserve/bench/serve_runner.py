"""Drive one workload against one live deployment and record what the client sees.

Owns `RunConfig` (arrivals: rate + burstiness, or closed loop at a max concurrency), the
`Backend` seam (anything with `stream(request) -> iterator of deltas`; `ClientBackend` wraps
`epdserve.Client`), and `run_requests`, which dispatches the requests on their seeded schedule
from worker threads, times every streamed message on the monotonic clock and returns one
`RequestRecord` per request, with a tqdm progress bar.

A delta is read duck-typed: `token_ids`, `text` (kept: a multi-turn history is built from it),
`finished`, `finish_reason`, and on the last one `usage` / `timing` (protobuf messages,
dataclasses, dicts or plain objects); usage's `cached_tokens` (KV-cached prompt tokens) is
recorded only when the server's usage has the field.
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

from epdserve.perf.arrivals import arrival_times
from epdserve.perf.serving_metrics import RequestRecord
from epdserve.perf.workload import BenchRequest

USAGE_FIELDS = ("prompt_tokens", "prompt_text_tokens", "vision_tokens", "cached_vision_tokens", "output_tokens",
                "cached_tokens")
TIMING_FIELDS = ("arrival", "dispatched", "encode_start", "encode_end", "prefill_start", "first_token",
                 "kv_transfer_end", "first_decode", "finished")


class Backend(Protocol):
    def stream(self, request: BenchRequest) -> Iterable: ...


class ClientBackend:
    """`epdserve.Client` streaming with max_tokens + ignore_eos (greedy): every answer is full length."""

    def __init__(self, address: str, timeout_s: float | None = None):
        from epdserve.client import Client

        self.address = address
        self.client = Client(address)
        self.timeout_s = timeout_s

    def stream(self, request: BenchRequest) -> Iterator:
        kwargs = {"timeout": self.timeout_s} if self.timeout_s else {}
        return iter(self.client.generate_stream(request.prompt, images=list(request.images), videos=list(request.videos),
                                                request_id=request.request_id,
                                                max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0,
                                                **kwargs))

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close:
            close()


@dataclass(frozen=True)
class RunConfig:
    rate: float = math.inf  # requests per second; inf = all at once (closed loop with max_concurrency)
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    max_concurrency: int | None = None  # at most this many requests in flight
    seed: int = 0
    progress: bool = True
    label: str = ""

    def describe(self) -> str:
        rate = "inf" if math.isinf(self.rate) else f"{self.rate:g}/s"
        mc = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return f"rate {rate} (burstiness {self.burstiness:g}){mc}"


def fields_of(obj, names: tuple[str, ...]) -> dict:
    """The named fields of a protobuf message / dataclass / dict / object (missing → absent)."""
    if obj is None:
        return {}
    get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
    return {k: get(k) for k in names if get(k) is not None}


def _error_text(e: BaseException) -> str:
    code = getattr(e, "code", None)
    if callable(code):
        try:
            details = e.details() if callable(getattr(e, "details", None)) else ""
            return f"{code().name}: {details}"[:200]
        except Exception:  # not a grpc.RpcError after all
            pass
    return f"{type(e).__name__}: {e}"[:200]


def send_one(backend: Backend, req: BenchRequest) -> RequestRecord:
    """One request through `backend`, timed message by message."""
    rec = RequestRecord(req.request_id, t0=0.0, kind=req.kind, num_images=len(req.images),
                        expected_output_tokens=req.max_tokens, turn=req.turn)
    text: list[str] = []
    rec.t0_wall, rec.t0 = time.time(), time.monotonic()
    finished, reason = False, ""
    try:
        for delta in backend.stream(req):
            now = time.monotonic()
            rec.end = now
            n = len(getattr(delta, "token_ids", None) or [])
            if n:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(n)
            piece = getattr(delta, "text", None)
            if piece:
                text.append(piece)
            if getattr(delta, "finished", False):
                finished, reason = True, getattr(delta, "finish_reason", "") or ""
                for k, v in fields_of(getattr(delta, "usage", None), USAGE_FIELDS).items():
                    setattr(rec, k, int(v))
                rec.timing = {k: float(v) for k, v in fields_of(getattr(delta, "timing", None), TIMING_FIELDS).items()}
    except Exception as e:  # any failure of this request is recorded, never raised
        rec.end, rec.error = time.monotonic(), _error_text(e)
        return rec
    finally:
        rec.output_text = "".join(text)
    if rec.end is None:
        rec.end = time.monotonic()
    if not finished:
        rec.error = "stream ended without a finished message"
    elif reason in ("abort", "error"):
        rec.error = f"finish_reason {reason}"
    elif not rec.chunk_times:
        rec.error = "no output tokens"
    rec.success = not rec.error
    return rec


def run_requests(backend: Backend, requests: list[BenchRequest], cfg: RunConfig,
                 offsets: list[float] | None = None) -> list[RequestRecord]:
    """Send `requests` on cfg's schedule (or at the given send `offsets`, s from the start, one per
    request: the shift workload's); returns their records in request order."""
    if offsets is None:
        offsets = arrival_times(len(requests), cfg.rate, cfg.burstiness, cfg.seed)
    elif len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} offsets for {len(requests)} requests")
    limit = threading.BoundedSemaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    records: list[RequestRecord | None] = [None] * len(requests)
    bar = _progress(len(requests), cfg)

    def work(i: int) -> None:
        try:
            records[i] = send_one(backend, requests[i])
        finally:
            if limit:
                limit.release()
            if bar is not None:
                bar.update(1)

    dispatch_at(offsets, work, limit, cfg, "bench-req")
    if bar is not None:
        bar.close()
    return [r for r in records if r is not None]


def dispatch_at(offsets: list[float], work, limit: threading.BoundedSemaphore | None, cfg: RunConfig,
                name: str) -> None:
    """Open loop: `work(i)` on a pool thread at `offsets[i]` seconds from now (after taking `limit`,
    which `work` releases); returns when every call has ended."""
    workers = min(len(offsets), cfg.max_concurrency or len(offsets), 512) or 1
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        for i, offset in enumerate(offsets):
            delay = start + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if limit:
                limit.acquire()
            pool.submit(work, i)


def _progress(total: int, cfg: RunConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=cfg.label or "requests", unit="req", leave=False, dynamic_ncols=True)
