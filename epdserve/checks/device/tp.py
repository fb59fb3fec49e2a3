"""`bench device` part `tp`: tensor parallelism on the device — the offline `LLM` at
tensor_parallel_size 2 (ranks on devices 0 and 1: NCCL on CUDA, HCCL on the NPU, gloo and
shared memory on the CPU), greedy, against transformers' greedy `generate` on one device, for a
dense family and the MoE one (its experts split over the ranks); then a prefill engine at 2 sending
its KV to a decode engine at 1 (tp_hop.py), D's tokens against transformers' the same way.

Per family: how many prompts agree token for token and each prompt's common prefix (fp32; the
all-reduce sums in another order than one device, so a difference is a near tie or a bug: the
common prefix says where). A machine with fewer than two devices reports the part skipped, with
the count it saw.
"""
from __future__ import annotations

import torch

from epdserve.checks.device.env import (
    CheckConfig, PartResult, checkpoint, free_device_memory, greedy, llm_request, prompts,
)
from epdserve.checks.device.exact import agreement
from epdserve.checks.device.tp_hop import run_hop

DEGREE = 2
ARCHS = ("qwen2_vl", "qwen3_vl_moe")


def run(cfg: CheckConfig, result: PartResult) -> None:
    from epdserve import LLM
    from epdserve.model.reference import ReferenceGenerator
    from epdserve.platform import get_platform

    plat = get_platform(cfg.device)
    count = plat.device_count() if plat.name != "cpu" else DEGREE
    if count < DEGREE:
        result.set("skipped", f"tensor_parallel_size={DEGREE} (and the P TP{DEGREE} -> D TP1 KV hop) needs {DEGREE} "
                              f"devices; {count} visible")
        return
    cases = prompts()
    for arch in ARCHS:
        key = f"{arch}/tp{DEGREE}/float32"
        try:
            d = checkpoint(cfg, arch)
            ref = ReferenceGenerator(d, device=cfg.device, dtype=torch.float32)
            want = [ref.generate(p, imgs, max_tokens=cfg.exact_tokens) for _, p, imgs in cases]
            del ref
            free_device_memory(cfg.device)
            llm = LLM(str(d), device=cfg.device, dtype="float32", tensor_parallel_size=DEGREE)
            try:
                outs = llm.generate([llm_request(p, imgs) for _, p, imgs in cases], greedy(cfg.exact_tokens))
                by_rank = list(llm.engine.encoder.encode.items_by_rank)
            finally:
                llm.engine.close()
            free_device_memory(cfg.device)
            result.set(key, {**agreement(cases, outs, want, cfg.exact_tokens), "media_encoded_by_rank": by_rank})
        except Exception as e:  # one family's failure is reported; the other still runs
            result.set(key, {"error": f"{type(e).__name__}: {str(e)[:400]}"})
            free_device_memory(cfg.device)
    key = f"hop/p-tp{DEGREE}-to-d-tp1/float32"
    try:  # the KV hop between degrees (tp_hop.py)
        result.set(key, run_hop(cfg, count))
    except Exception as e:
        result.set(key, {"error": f"{type(e).__name__}: {str(e)[:400]}"})
        free_device_memory(cfg.device)


def summary(data: dict) -> str:
    if "skipped" in data:
        return f"skipped: {data['skipped']}"
    return ", ".join(f"{k} {v['equal']}/{v['of']}" if "equal" in v else f"{k} FAILED"
                     for k, v in data.items() if isinstance(v, dict))
