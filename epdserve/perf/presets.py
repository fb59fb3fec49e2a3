"""The named serving workloads (`bench serve --workload NAME`, `plan --workload NAME`) and their rates.

`PRESETS`: name → `WorkloadConfig`; `PRESET_RATES`: name → the request-rate sweep (req/s) that
`bench serve` runs by default and `launch --mode auto` plans for (its busier rate).
"""
from __future__ import annotations

from epdserve.perf.workload import WorkloadConfig

# Presets scaled for a 2-core CPU and the small demo model (see `epdserve profile`): resolutions
# at a quarter of their sides (360p → 160x90, 720p → 320x180, 1080p → 480x270: 18–170 vision
# tokens instead of 300–1280) and outputs about a tenth of ShareGPT-4o's 600±140 tokens.
_CPU = WorkloadConfig(num_requests=16, resolution_scale=0.25, output_len_mean=60, output_len_std=14,
                      output_len_min=8, output_len_max=120, text_prompt_words_mean=60, text_prompt_words_std=20)
PRESETS = {
    "sharegpt4o": _CPU.with_(name="sharegpt4o"),
    # (a) several images per request, short outputs: the encoder dominates
    "image-heavy": _CPU.with_(name="image-heavy", num_requests=10, images_min=2, images_max=4, output_len_mean=12,
                              output_len_std=3, output_len_min=4, output_len_max=24,
                              resolution_mix=(("360p", 0.4), ("720p", 0.4), ("1080p", 0.2))),
    # (b) mixed traffic: half the requests are text-only
    "mixed": _CPU.with_(name="mixed", text_only_share=0.5, output_len_mean=24, output_len_std=6,
                        output_len_min=4, output_len_max=48),
    # (c) text-heavy with long outputs: few and small images, decode dominates
    "text-heavy": _CPU.with_(name="text-heavy", num_requests=12, text_only_share=0.8, output_len_mean=96,
                             output_len_std=24, output_len_min=32, output_len_max=160,
                             resolution_mix=(("360p", 1.0),), text_prompt_words_mean=120, text_prompt_words_std=30),
    # (d) video: one short clip per request (1, 2 or 4 s at 8 fps; 240p-480p at a quarter of their
    # sides), short outputs: every sampled frame is encoded, the load EPD exists for
    "video": _CPU.with_(name="video", num_requests=12, video_share=1.0, output_len_mean=12, output_len_std=3,
                        output_len_min=4, output_len_max=24),
    # (e) four full 640x360 images a request, a few output tokens: TTFT is encode + prefill, what
    # per-item E->P pipelining overlaps (engine/pipelined_prefill.py; run it one at a time)
    "multi-image": _CPU.with_(name="multi-image", num_requests=8, images_min=4, images_max=4, resolution_scale=1.0,
                              resolution_mix=(("360p", 1.0),), output_len_mean=8, output_len_std=0,
                              output_len_min=8, output_len_max=8),
}
# The request-rate sweep of each preset (req/s) on that CPU: about 40% and 80% of what the
# monolithic deployment sustains, measured with the presets above.
PRESET_RATES = {"sharegpt4o": (0.25, 0.5), "image-heavy": (0.2, 0.4), "mixed": (0.5, 1.0), "text-heavy": (0.4, 0.8),
                # bench/shift.py (image-heavy -> text-heavy -> mixed): not measured; the second rate is
                # over image-heavy's sweep and under the others', so the first phase alone overloads
                "shift": (0.3, 0.6),
                # perf/multiturn.py: conversations started per second (each sends its turns one after
                # another); not measured: about one conversation in flight at the lower rate
                "multiturn": (0.1, 0.25)}
