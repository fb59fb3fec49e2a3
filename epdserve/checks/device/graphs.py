"""`bench device` part `graphs`: do decode graphs replay, and do they change nothing? (issue 52)

On a device with graphs (CUDA; an NPU whose torch_npu has the graph-task API): the offline `LLM` with graphs (captured at start-up) against the
same with `enforce_eager=True`, bf16, the tiny demo Qwen2-VL, at batch 1, 3 (padding rows in a
bucket of 4) and 32, each prompt ~100 tokens and 48 new ones so every context crosses from width
bucket 8 blocks to 16 mid-run (a capture mid-run): greedy tokens equal per prompt; the graph
evidence (keys, capture seconds, replays, eager decode steps by reason: engine/model_runner.py
`graph_report`); TPOT with graphs and eagerly at batch 1 and 32 (perf.py's `_tpot_ms`); device
kernels, kernel launches and graph launches per decode token at batch 1, both ways (`_launches`:
replay must show about one cudaGraphLaunch a token and few kernel launches); and a final
`empty_cache()` that must succeed (a capture left half-open breaks it). On a platform without graphs
(the CPU; an NPU without the API) the part reports itself skipped. Never run on a GPU or an NPU yet
(on the NPU, scripts/npu_first_run.sh's `graphs` step is the first run).
"""
from __future__ import annotations

from epdserve.checks.device.env import CheckConfig, PartResult, checkpoint, free_device_memory, greedy

BATCHES = (1, 3, 32)
NEW_TOKENS = 48
TPOT_TOKENS = 33


def _prompts(b: int) -> list[str]:
    return [" ".join(f"word{j}" for j in range(90 + 7 * i)) + f" item {i}, go on" for i in range(b)]


def run(cfg: CheckConfig, result: PartResult) -> None:
    from epdserve import LLM
    from epdserve.checks.device.perf import _tpot_ms
    from epdserve.platform import get_platform

    plat = get_platform(cfg.device)
    if not plat.has_graphs:
        result.set("skipped", f"{plat.name} has no decode graphs: every decode step runs eagerly")
        return
    model = str(checkpoint(cfg, "qwen2_vl"))
    runs = {}
    for name, eager in (("graphs", False), ("eager", True)):
        llm = LLM(model, device=cfg.device, dtype="bfloat16", max_num_seqs=max(BATCHES), enforce_eager=eager)
        try:
            outs = {b: [o.outputs[0].token_ids for o in llm.generate(_prompts(b), greedy(NEW_TOKENS))] for b in BATCHES}
            tpot = {b: round(_tpot_ms(lambda k, b=b: llm.generate(_prompts(b), greedy(k)), TPOT_TOKENS, cfg.device,
                                      2)[0], 2) for b in (1, 32)}
            runs[name] = (outs, tpot, llm.engine.runner.graph_report())
            result.set(f"launches_{name}", _launches(llm, cfg.device))
        finally:
            llm.engine.close()
            free_device_memory(cfg.device)
    (g_outs, g_tpot, report), (e_outs, e_tpot, _) = runs["graphs"], runs["eager"]
    for b in BATCHES:
        equal = sum(g == e for g, e in zip(g_outs[b], e_outs[b]))
        result.set(f"batch{b}", {"equal": equal, "of": b})
    result.set("evidence", {"graphs": report["graphs"], "why_off": report["why_off"], "keys": report["keys"],
                            "capture_s": round(report["capture_s"], 2), "replays": report["replays"],
                            "eager_decode_steps": report["eager_decode_steps"]})
    result.set("tpot_ms", {f"b{b}": {"graphs": g_tpot[b], "eager": e_tpot[b],
                                     "eager_over_graphs": round(e_tpot[b] / g_tpot[b], 2) if g_tpot[b] else None}
                           for b in (1, 32)})
    try:
        import torch

        getattr(torch, plat.name).empty_cache()
        result.set("empty_cache", "ok")
    except Exception as e:  # a capture left half-open makes the allocator assert here
        result.set("empty_cache", f"{type(e).__name__}: {str(e)[:300]}")


def _launches(llm, device: str) -> dict:
    """Per decode token at batch 1 (profile.ops_per_token): device kernels, kernel launches and
    graph launches — replayed, a step is one cudaGraphLaunch and the few kernels sampling launches;
    eagerly, a launch per kernel."""
    from epdserve.checks.device.profile import ops_per_token

    try:
        c = ops_per_token(lambda k: llm.generate(_prompts(1), greedy(k)), device)
    except Exception as e:  # the profiler is a figure, not the part
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {k: c[k] for k in ("device_kernels", "kernel_launches", "graph_launches")}


def summary(data: dict) -> str:
    if "skipped" in data:
        return f"skipped: {data['skipped']}"
    eq = ", ".join(f"b{b} {data[f'batch{b}']['equal']}/{b}" for b in BATCHES if f"batch{b}" in data)
    ev = data.get("evidence", {})
    return f"tokens equal to eager: {eq}; {ev.get('keys')} keys, {ev.get('replays')} replays; " \
           f"empty_cache {data.get('empty_cache')}"
