"""`bench serve --workload upload-then-ask`: what encoding at upload saves the question's TTFT.

Per request i, one after another (a closed loop: the ask's TTFT is the point, not throughput),
three requests with the same short question and greedy output of `max_tokens`:
- **bytes**: the question carrying a fresh image's bytes (today's behaviour: encoded on the
  request's clock);
- **upload-then-ask**: another fresh image uploaded (`Client.upload`: encoded at once), then
  `think_time_s` of client think time, then the question referencing it by file id;
- **text**: the same question without any image (the floor).
Images are procedural, `width` x `height` (640x360 by default), never repeated, so no run is
served from an earlier run's cache. The run's metrics are the asks'; `extra["upload_then_ask"]`
has, per kind, TTFT percentiles (p25/p50/p75, min/max: the spread) and the ratios of the asks'
p50 to the bytes' and to the text's. Needs the epdserve gRPC backend (uploads are its RPC).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

from epdserve.bench.serve_runner import send_one
from epdserve.client import FileId
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.perf.workload import PLACEHOLDER, BenchRequest

UPLOAD_THEN_ASK = "upload-then-ask"
QUESTION = "Describe this picture in one sentence."


@dataclass(frozen=True)
class UploadAskConfig:
    name: str = UPLOAD_THEN_ASK
    num_requests: int = 8
    width: int = 640
    height: int = 360
    think_time_s: float = 1.0
    max_tokens: int = 8
    seed: int = 0

    def with_(self, **changes) -> UploadAskConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"{self.num_requests} x (bytes-carrying / upload, {self.think_time_s:g} s think, ask by file id / "
                f"no image), one {self.width}x{self.height} image, {self.max_tokens} output tokens, one at a time")


def upload_ask_config(args) -> UploadAskConfig:
    changes: dict = {"seed": args.seed}
    if args.num_requests:
        changes["num_requests"] = args.num_requests
    if getattr(args, "think_time_s", None) is not None:
        changes["think_time_s"] = args.think_time_s
    if args.output_len is not None:
        changes["max_tokens"] = max(1, int(args.output_len))
    return UploadAskConfig().with_(**changes)


def _prompt(image: bool) -> str:
    return f"<|im_start|>user\n{PLACEHOLDER if image else ''}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def spread(values: list[float]) -> dict:
    """p25/p50/p75 and min/max of `values` (ms), None where there are none."""
    if not values:
        return {"n": 0, "p25": None, "median": None, "p75": None, "min": None, "max": None}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"n": len(values), "p25": round(q[0], 1), "median": round(q[1], 1), "p75": round(q[2], 1),
            "min": round(min(values), 1), "max": round(max(values), 1)}


def run_upload_ask(backend, cfg: UploadAskConfig, rc, slo) -> tuple[list, dict]:
    client = getattr(backend, "client", None)
    if client is None or not hasattr(client, "upload"):
        raise SystemExit(f"--workload {UPLOAD_THEN_ASK} needs the epdserve backend (uploads are its gRPC API)")
    kinds: dict[str, list] = {"bytes": [], "ask": [], "text": []}
    upload_ms: list[float] = []
    for i in range(cfg.num_requests):
        base = cfg.seed * 100_003 + 2 * i
        carried = jpeg_bytes(procedural_image(cfg.width, cfg.height, seed=base))
        uploaded = jpeg_bytes(procedural_image(cfg.width, cfg.height, seed=base + 1))
        kinds["bytes"].append(send_one(backend, BenchRequest(f"bytes-{i}", _prompt(True), [carried],
                                                             max_tokens=cfg.max_tokens)))
        t0 = time.monotonic()
        up = client.upload(uploaded, f"bench-{i}.jpg")
        upload_ms.append(1e3 * (time.monotonic() - t0))
        time.sleep(cfg.think_time_s)  # the client's think time between upload and question (the workload's shape)
        kinds["ask"].append(send_one(backend, BenchRequest(f"ask-{i}", _prompt(True), [FileId(up.file_id)],
                                                           max_tokens=cfg.max_tokens)))
        kinds["text"].append(send_one(backend, BenchRequest(f"text-{i}", _prompt(False), [],
                                                            max_tokens=cfg.max_tokens)))
        client.delete_upload(up.file_id)
    ttft = {k: spread([1e3 * r.ttft for r in recs if r.success and r.ttft is not None]) for k, recs in kinds.items()}
    p50 = {k: v["median"] for k, v in ttft.items()}
    ratios = {"ask_vs_bytes": _ratio(p50["ask"], p50["bytes"]), "ask_vs_text": _ratio(p50["ask"], p50["text"])}
    failed = {k: sum(1 for r in recs if not r.success) for k, recs in kinds.items()}
    return kinds["ask"], {"upload_then_ask": {"ttft_ms": ttft, "ratios": ratios, "upload_ms": spread(upload_ms),
                                              "failed": failed}}


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def summary_line(extra: dict) -> str:
    u = extra["upload_then_ask"]
    t, r = u["ttft_ms"], u["ratios"]
    return (f"TTFT p50 bytes {t['bytes']['median']} ms, ask {t['ask']['median']} ms, text {t['text']['median']} ms; "
            f"ask/bytes {r['ask_vs_bytes']}, ask/text {r['ask_vs_text']}")
