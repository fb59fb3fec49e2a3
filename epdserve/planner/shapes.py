"""A workload as the planner sees it: request shapes, from a preset or from a recorded trace.

`RequestShape` is what a request costs, not its bytes: arrival offset (s), vision tokens of each
media item (image or clip), text tokens of the prompt, output tokens (the benchmarks use
ignore_eos, so max_tokens is the output length).

- `shapes_from_preset(name, rate, ...)`: the same requests and arrival schedule `epdserve bench
  serve --workload NAME --request-rate RATE` sends (`perf.workload.build_workload` +
  `perf.arrivals.arrival_times`), counted with the scheduler's own preprocessor on a checkpoint
  (tokenizer + image processor; no weights are loaded), so vision and text token counts are the
  server's.
- `shapes_from_trace(results, ...)`: one run of a `bench serve` results JSON: per-request prompt,
  vision and output tokens as the server reported them, arrivals from the run's rate, burstiness
  and seed (what `bench serve` sends on). A request's vision tokens are split evenly over its
  images (the records keep only the total); the encoder batches a request's images together, so
  this moves little.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from epdserve.perf.arrivals import arrival_times
from epdserve.perf.presets import PRESETS
from epdserve.planner.reports import read_report


class WorkloadError(ValueError):
    """An unknown preset, an unreadable trace, or a run the trace does not hold."""


@dataclass(frozen=True)
class RequestShape:
    request_id: str
    arrival_s: float
    vision_items: tuple[int, ...]  # vision tokens of each image / clip
    text_tokens: int
    output_tokens: int
    kind: str = "image"  # image | text | video

    @property
    def vision_tokens(self) -> int:
        return sum(self.vision_items)

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + self.vision_tokens


def preset_config(name: str, num_requests: int | None = None, seed: int = 0):
    if name not in PRESETS:
        raise WorkloadError(f"unknown workload {name!r}; presets: {', '.join(PRESETS)}")
    changes = {"seed": seed}
    if num_requests:
        changes["num_requests"] = num_requests
    return PRESETS[name].with_(**changes)


def count_tokens(requests, model_dir: str) -> list[tuple[tuple[int, ...], int]]:
    """(vision tokens per media item, text tokens) of each `BenchRequest`, by the scheduler's
    preprocessor for `model_dir`."""
    if not (Path(model_dir) / "config.json").is_file():
        raise WorkloadError(f"cannot count prompt tokens: {model_dir} is not a checkpoint directory "
                            "(pass --model DIR with the served model's tokenizer and image processor, or --trace)")
    from epdserve.scheduler.preprocess import RequestPreprocessor

    proc = RequestPreprocessor(model_dir).processor
    out = []
    for r in requests:
        done = proc.process(r.prompt, images=r.images, videos=r.videos or None)
        items = tuple(int(m.num_tokens) for m in done.media)
        out.append((items, len(done.token_ids) - sum(items)))
    return out


def shapes_from_preset(name: str, rate: float, model_dir: str, num_requests: int | None = None,
                       burstiness: float = 1.0, seed: int = 0) -> list[RequestShape]:
    from epdserve.perf.workload import build_workload

    cfg = preset_config(name, num_requests, seed)
    requests = build_workload(cfg)
    arrivals = arrival_times(len(requests), rate, burstiness, cfg.seed)
    counts = count_tokens(requests, model_dir)
    return [RequestShape(r.request_id, t, items, text, r.max_tokens, r.kind)
            for r, t, (items, text) in zip(requests, arrivals, counts)]


def _rate(value) -> float:
    if value is None or (isinstance(value, str) and value.lower() in ("inf", "infinity")):
        return math.inf
    return float(value)


def load_results(path: str | Path) -> dict:
    data = read_report(path, "serve", WorkloadError, "results file", "`epdserve bench serve` results file")
    if not isinstance(data.get("workloads"), dict):
        raise WorkloadError(f"{path}: not an `epdserve bench serve` results file (no workloads)")
    return data


def shapes_from_run(run: dict) -> list[RequestShape]:
    """Request shapes of one run entry (`workloads.W.modes.M.runs[i]`) of a results file."""
    rows = run.get("requests") or []
    if not rows:
        raise WorkloadError("the run has no per-request records")
    arrivals = arrival_times(len(rows), _rate(run.get("rate")), float(run.get("burstiness") or 1.0),
                             int(run.get("seed") or 0))
    out = []
    for row, t in zip(rows, arrivals):
        vision = int(row.get("vision_tokens") or 0)
        n_items = int(row.get("images") or 0) or (1 if vision else 0)
        items = tuple(vision // n_items + (1 if i < vision % n_items else 0) for i in range(n_items)) if vision else ()
        out.append(RequestShape(str(row.get("id")), t, items, max(0, int(row.get("prompt_tokens") or 0) - vision),
                                max(1, int(row.get("output_tokens") or 1)), str(row.get("kind") or "image")))
    return out


def shapes_from_trace(path: str | Path, workload: str | None = None, rate: float | None = None) -> list[RequestShape]:
    """Shapes of one run in a results file: the first workload (or `workload`), the first run at
    `rate` (or the first run) of its first mode (every mode got the same requests)."""
    data = load_results(path)
    names = list(data["workloads"])
    name = workload or (names[0] if names else None)
    if name not in data["workloads"]:
        raise WorkloadError(f"{path}: no workload {name!r}; it has {', '.join(names) or 'none'}")
    for mode in data["workloads"][name].get("modes", {}).values():
        for run in mode.get("runs", []):
            if rate is None or math.isclose(_rate(run.get("rate")), rate):
                return shapes_from_run(run)
    raise WorkloadError(f"{path}: workload {name!r} has no run" + (f" at rate {rate:g}" if rate is not None else ""))
