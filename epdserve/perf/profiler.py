"""The profiling run: what each stage costs on this device, measured through the engine (no server).

`run_profile(model, ...)` measures vision encoder ms per image at several resolutions (JPEG
decode + preprocessing timed apart), prefill ms per prompt length, decode ms per step at several
batch sizes, and the bytes that travel between stages (image features E→P, KV cache P→D) per
request, and returns the report (its format: perf/profile_report.py). Each number is the median
of `repeats` runs after one warm-up. torch and the engine are imported inside `run_profile`, so
importing this module stays light. Callers: `epdserve profile` (bench/profile.py) and
`launch --mode auto` when it has no profile (planner/auto.py).
"""
from __future__ import annotations

import statistics
import time

from epdserve.perf.profile_report import unloaded_ttft
from epdserve.perf.workload import RESOLUTIONS

DEFAULT_RESOLUTIONS = "224x224,360p,720p"
DEFAULT_PROMPT_LENS = "64,256,1024"
DEFAULT_BATCH_SIZES = "1,4,16,32"


def parse_resolution(text: str) -> tuple[str, int, int]:
    """'360p' or 'WxH' → (name, width, height)."""
    text = text.strip()
    if text in RESOLUTIONS:
        return (text, *RESOLUTIONS[text])
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"resolution must be one of {sorted(RESOLUTIONS)} or WxH, got {text!r}") from None
    if w < 1 or h < 1:
        raise ValueError(f"resolution must be positive, got {text!r}")
    return text, w, h


def int_list(text: str) -> list[int]:
    """'1,4,16' → [1, 4, 16]; ValueError unless every value is a positive int."""
    vals = [int(v) for v in text.split(",") if v.strip()]
    if not vals or min(vals) < 1:
        raise ValueError(f"expected a comma-separated list of positive ints, got {text!r}")
    return vals


class _Timer:
    def __init__(self, platform):
        self.platform = platform

    def __call__(self, fn) -> float:
        """Wall ms of fn() with the device synchronized before and after."""
        self.platform.synchronize()
        t0 = time.perf_counter()
        fn()
        self.platform.synchronize()
        return (time.perf_counter() - t0) * 1e3


def _median(fn, timer: _Timer, repeats: int) -> float:
    timer(fn)  # warm-up
    return statistics.median(timer(fn) for _ in range(repeats))


def profile_vision(engine, resolutions: list[str], repeats: int, timer: _Timer) -> list[dict]:
    from epdserve.model.demo_images import jpeg_bytes, procedural_image

    rows = []
    for res in resolutions:
        name, w, h = parse_resolution(res)
        data = jpeg_bytes(procedural_image(w, h, seed=w * 7 + h), quality=85)
        media = engine.processor.preprocess_image(data)
        pre_ms = _median(lambda: engine.processor.preprocess_image(data), timer, repeats)
        feats: list = []
        enc_ms = _median(lambda: feats.__setitem__(slice(None), engine.model.adapter.encode_images(
            [media.pixel_values], [media.grid_thw])), timer, repeats)
        feature_bytes = sum(t.numel() * t.element_size() for t in feats[0])
        rows.append({"resolution": name, "width": w, "height": h, "jpeg_bytes": len(data),
                     "vision_tokens": media.num_tokens, "preprocess_ms": pre_ms, "encode_ms": enc_ms,
                     "encode_ms_per_token": enc_ms / media.num_tokens, "feature_bytes": feature_bytes})
    return rows


def _prompt(engine, n: int, salt: int) -> list[int]:
    vocab = engine.model.adapter.text_config.vocab_size
    lo = min(100, vocab // 2)  # clear of the special tokens at the end and the byte tokens at the start
    return [lo + (i * 7919 + salt * 104729) % (vocab - lo - 16) for i in range(n)]


def _run_until_done(engine, ids: set[str]) -> None:
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)


def profile_prefill(engine, prompt_lens: list[int], repeats: int, timer: _Timer) -> list[dict]:
    from epdserve.engine.sampling_params import SamplingParams

    rows, counter = [], iter(range(1 << 30))
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def one(n: int):
        rid = f"prefill-{next(counter)}"
        engine.add_request(engine.build_request(rid, _prompt(engine, n, int(rid.split("-")[1])), None, params))
        _run_until_done(engine, {rid})

    for n in prompt_lens:
        ms = _median(lambda: one(n), timer, repeats)
        rows.append({"prompt_tokens": n, "prefill_ms": ms, "prefill_ms_per_token": ms / n,
                     "prefill_tokens_per_s": n / ms * 1e3})
    return rows


def profile_decode(engine, batch_sizes: list[int], prompt_len: int, steps: int, timer: _Timer) -> list[dict]:
    from epdserve.engine.sampling_params import SamplingParams

    rows = []
    for b in batch_sizes:
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
        ids = [f"decode-{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            engine.add_request(engine.build_request(rid, _prompt(engine, prompt_len, 1000 + i), None, params))
        have_first: set[str] = set()
        while len(have_first) < b:  # every prompt prefilled: from now on a step is pure decode
            have_first.update(o.request_id for o in engine.step() if o.token_ids)
        times = [timer(engine.step) for _ in range(steps)]
        for rid in ids:
            engine.abort(rid)
        engine.step()
        ms = statistics.median(times[1:] if len(times) > 1 else times)
        rows.append({"batch_size": b, "decode_ms_per_step": ms, "decode_tokens_per_s": b / ms * 1e3,
                     "context_tokens": prompt_len})
    return rows


def kv_bytes_per_token(engine) -> int:
    spec = engine.kv_cache.spec
    return spec.bytes_per_block() // spec.block_size


def run_profile(model: str, device: str = "auto", resolutions: list[str] | None = None,
                prompt_lens: list[int] | None = None, batch_sizes: list[int] | None = None,
                repeats: int = 3, decode_steps: int = 8, decode_context: int = 128, text_tokens: int = 32,
                tensor_parallel_size: int = 1) -> dict:
    """Profile one checkpoint at one tensor-parallel degree (its ranks as the engine starts them);
    returns the JSON-ready report."""
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.llm_engine import LLMEngine

    resolutions = resolutions or DEFAULT_RESOLUTIONS.split(",")
    prompt_lens = prompt_lens or int_list(DEFAULT_PROMPT_LENS)
    batch_sizes = batch_sizes or int_list(DEFAULT_BATCH_SIZES)
    cfg = EngineConfig(model=str(model), device=device, max_num_batched_tokens=max(2048, max(prompt_lens)),
                       max_num_seqs=max(batch_sizes), enable_chunked_prefill=False,
                       tensor_parallel_size=tensor_parallel_size)
    engine = LLMEngine(cfg)
    try:
        return _measure(engine, resolutions, prompt_lens, batch_sizes, repeats, decode_steps, decode_context,
                        text_tokens, tensor_parallel_size)
    finally:
        engine.close()  # a TP engine's ranks end with it


def _measure(engine, resolutions, prompt_lens, batch_sizes, repeats, decode_steps, decode_context, text_tokens,
             tensor_parallel_size) -> dict:
    import torch

    timer = _Timer(engine.platform)
    t0 = time.time()
    vision = profile_vision(engine, resolutions, repeats, timer)
    prefill = profile_prefill(engine, prompt_lens, repeats, timer)
    decode = profile_decode(engine, batch_sizes, decode_context, decode_steps, timer)
    kv_tok = kv_bytes_per_token(engine) * tensor_parallel_size  # every rank's heads: what a D at this degree gets
    per_request = [{"resolution": v["resolution"], "prompt_tokens": v["vision_tokens"] + text_tokens,
                    "feature_bytes": v["feature_bytes"], "kv_bytes": (v["vision_tokens"] + text_tokens) * kv_tok}
                   for v in vision]
    per_request.insert(0, {"resolution": "text-only", "prompt_tokens": text_tokens, "feature_bytes": 0,
                           "kv_bytes": text_tokens * kv_tok})
    a = engine.model.adapter
    report = {
        "benchmark": "profile", "model": engine.config.model, "device": str(engine.model.device), "platform": engine.platform.name,
        "tensor_parallel_size": tensor_parallel_size,
        "dtype": str(a.dtype).replace("torch.", ""), "torch_threads": torch.get_num_threads(),
        "model_info": {"layers": a.num_layers, "hidden": a.hidden_size, "kv_heads": a.num_kv_heads,
                       "head_dim": a.head_dim, "vision_params": sum(p.numel() for p in a.vision_tower.parameters()),
                       "total_params": sum(p.numel() for p in a.vision_tower.parameters())
                       + engine.model.lm.num_parameters()},
        "repeats": repeats, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
        "seconds": round(time.time() - t0, 2),
        "vision": vision, "prefill": prefill, "decode": decode,
        "kv_bytes_per_token": kv_tok, "per_request": per_request, "text_tokens_per_request": text_tokens,
    }
    report["unloaded_ttft"] = unloaded_ttft(report)
    return report
