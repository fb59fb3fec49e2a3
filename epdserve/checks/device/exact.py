"""`bench device` part `exact`: offline `LLM` greedy output against transformers' greedy `generate`
on the same device, for the tiny demo model of each family (one image, two images, text only).

Per family and dtype: how many prompts agree token for token, and per prompt the common prefix
length (fp32 must agree in full; bf16 is reported, not required: the issue's aim is the first 16
tokens). The oracle is `model.reference.ReferenceGenerator` on the device.
"""
from __future__ import annotations

import torch

from epdserve.checks.device.env import (
    CheckConfig, PartResult, checkpoint, common_prefix, free_device_memory, greedy, llm_request, prompts,
)


def run(cfg: CheckConfig, result: PartResult) -> None:
    from epdserve import LLM
    from epdserve.model.reference import ReferenceGenerator

    cases = prompts()
    for arch in cfg.exact_archs:
        for dtype in cfg.exact_dtypes:
            key = f"{arch}/{dtype}"
            try:
                d = checkpoint(cfg, arch)
                ref = ReferenceGenerator(d, device=cfg.device, dtype=getattr(torch, dtype))
                want = [ref.generate(p, imgs, max_tokens=cfg.exact_tokens) for _, p, imgs in cases]
                del ref
                free_device_memory(cfg.device)
                llm = LLM(str(d), device=cfg.device, dtype=dtype)
                outs = llm.generate([llm_request(p, imgs) for _, p, imgs in cases], greedy(cfg.exact_tokens))
                del llm
                free_device_memory(cfg.device)
                result.set(key, agreement(cases, outs, want, cfg.exact_tokens))
            except Exception as e:  # one family's failure is reported; the others still run
                result.set(key, {"error": f"{type(e).__name__}: {str(e)[:400]}"})
                free_device_memory(cfg.device)


def agreement(cases, outs, want: list[list[int]], tokens: int) -> dict:
    """How many of `outs` (RequestOutputs) equal `want` (transformers' tokens), each case's
    common prefix, and the errors of those that failed."""
    got = [list(o.outputs[0].token_ids) for o in outs]
    entry = {"equal": sum(g == w for g, w in zip(got, want)), "of": len(cases),
             "common_prefix": {name: common_prefix(g, w) for (name, _, _), g, w in zip(cases, got, want)},
             "tokens": tokens}
    errors = [o.error for o in outs if getattr(o, "error", None)]
    if errors:
        entry["errors"] = errors
    return entry


def summary(data: dict) -> str:
    """One line: `arch/dtype k/n` per case."""
    parts = []
    for key, v in data.items():
        if not isinstance(v, dict):
            continue
        parts.append(f"{key} {v['equal']}/{v['of']}" if "equal" in v else f"{key} FAILED")
    return ", ".join(parts)
