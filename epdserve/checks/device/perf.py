"""`bench device` part `perf`: decode speed of a Qwen2-VL-2B-shaped checkpoint (demo `--size 2b`:
its LM and ViT shapes, demo vocabulary, random weights) against transformers and the memory floor.

Per dtype (bf16 on an accelerator; fp32 and bf16 on CPU, on the `small` demo model), offline:
- epdserve `LLM`: decode TPOT at batch 1 and at batch `perf_batch`, each the difference of a
  `perf_tokens`-token and a 1-token greedy generate over `perf_tokens - 1` steps (prefill cancels
  out), median of `perf_repeats`; the batch's decode tok/s (batch / TPOT) and its end-to-end tok/s
  (batch x tokens / wall time, prefill included);
- operators per decode token at batch 1 (`profile.ops_per_token`): device kernels, host aten ops
  and profiler events, kernel and graph launches (cudaLaunchKernel / cudaGraphLaunch), and the
  attention kernels that ran (which backend SDPA chose, and the Triton decode kernel); device
  kernels per LM layer (a token's kernels over the layers: an upper bound; issue 52's aim ≤ 12);
- the served TPOT of one request alone (`served`, first dtype only) and its ratio to offline;
- transformers' `generate` (eager, its own cache) at the same batch sizes, the same way;
- the memory floor: the LM's parameter bytes / the device's memory bandwidth (`--bandwidth`,
  default 4.8e12 B/s on an H200, else unknown: "n/a"), and TPOT / floor.
Every figure is written as soon as it is measured (a timeout keeps the earlier ones).
"""
from __future__ import annotations

import math
import os

import torch

from epdserve.checks.device.env import TEXT, CheckConfig, PartResult, checkpoint, free_device_memory, greedy, timed

KNOWN_BANDWIDTH = {"H200": 4.8e12}  # bytes/s, by a word of torch.cuda.get_device_name()


def device_bandwidth(cfg: CheckConfig) -> float | None:
    if cfg.bandwidth:
        return cfg.bandwidth
    if cfg.device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((bw for word, bw in KNOWN_BANDWIDTH.items() if word in name), None)
    return None


def lm_parameter_count(model_dir) -> int:
    """Parameters of everything but the vision tower (embeddings and LM head included), from the files."""
    from safetensors import safe_open

    n = 0
    for path in sorted(os.listdir(model_dir)):
        if path.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, path), framework="pt") as f:
                n += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "visual" not in k)
    return n


def _tpot_ms(run_n, n: int, device: str, repeats: int) -> tuple[float, float]:
    """(decode TPOT ms, wall seconds of the n-token run) from n-token and 1-token runs."""
    t_n = timed(lambda: run_n(n), device, repeats)
    t_1 = timed(lambda: run_n(1), device, repeats)
    return (t_n - t_1) / (n - 1) * 1e3, t_n


def run(cfg: CheckConfig, result: PartResult) -> None:
    model = checkpoint(cfg, "qwen2_vl", cfg.perf_size)
    params = lm_parameter_count(model)
    bandwidth = device_bandwidth(cfg)
    result.set("model", {"size": cfg.perf_size, "lm_params_M": round(params / 1e6, 1),
                         "bandwidth_Bps": bandwidth, "tokens": cfg.perf_tokens, "batch": cfg.perf_batch})
    for i, dtype in enumerate(cfg.perf_dtypes):
        fig: dict = {}
        nbytes = params * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        fig["lm_param_GB"] = round(nbytes / 1e9, 3)
        fig["floor_ms"] = round(nbytes / bandwidth * 1e3, 3) if bandwidth else "n/a"
        result.set(dtype, fig)
        _epdserve(cfg, str(model), dtype, fig, lambda: result.set(dtype, fig), served=cfg.perf_served and i == 0)
        if cfg.perf_transformers:
            _transformers(cfg, str(model), dtype, fig, lambda: result.set(dtype, fig))
        if isinstance(fig["floor_ms"], float) and fig.get("epd_tpot_b1_ms"):
            fig["epd_b1_over_floor"] = round(fig["epd_tpot_b1_ms"] / fig["floor_ms"], 1)
        result.set(dtype, fig)


def _epdserve(cfg: CheckConfig, model: str, dtype: str, fig: dict, save, served: bool) -> None:
    from epdserve import LLM
    from epdserve.checks.device.profile import ops_per_token

    n, b, reps = cfg.perf_tokens, cfg.perf_batch, cfg.perf_repeats
    llm = LLM(model, device=cfg.device, dtype=dtype, max_num_seqs=max(b, 1))
    batch = [TEXT + f" #{i}" for i in range(b)]
    llm.generate([TEXT], greedy(4))  # warm-up
    tpot, _ = _tpot_ms(lambda k: llm.generate([TEXT], greedy(k)), n, cfg.device, reps)
    fig["epd_tpot_b1_ms"] = round(tpot, 2)
    save()
    tpot, wall = _tpot_ms(lambda k: llm.generate(batch, greedy(k)), n, cfg.device, max(1, reps - 1))
    fig[f"epd_tpot_b{b}_ms"] = round(tpot, 2)
    fig[f"epd_decode_tok_s_b{b}"] = round(b / tpot * 1e3, 1)
    fig[f"epd_e2e_tok_s_b{b}"] = round(b * n / wall, 1)
    save()
    try:
        table = os.path.join(cfg.out_dir, f"profile-{dtype}.txt")
        counts = ops_per_token(lambda k: llm.generate([TEXT], greedy(k)), cfg.device, table_path=table)
        fig["attention_kernels"] = counts.pop("attention_kernels")
        fig.update({f"{k}_per_token_b1": v for k, v in counts.items()})
        layers = len(llm.engine.runner.lm.layers)
        if counts["device_kernels"] is not None:  # a token's every kernel over the layers: an upper bound
            fig["kernels_per_layer_b1"] = round(counts["device_kernels"] / layers, 1)
    except Exception as e:  # the profiler is a figure, not the part
        fig["profile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    g = llm.engine.runner.graph_report()  # did decode replay graphs here? (issue 52 item 3)
    fig.update(graphs="on" if g["graphs"] else f"off: {g['why_off']}", graph_keys=g["keys"],
               graph_capture_s=round(g["capture_s"], 2), graph_replays=g["replays"],
               eager_decode_steps=sum(g["eager_decode_steps"].values()),
               paged_ops=llm.engine.runner.ops.name)
    save()
    del llm
    free_device_memory(cfg.device)
    if served:
        from epdserve.checks.device.served import served_tpot_ms

        try:
            fig.update(served_tpot_ms(cfg, model, dtype, n))
            if fig.get("served_tpot_b1_ms") and fig.get("epd_tpot_b1_ms"):
                fig["served_over_offline_b1"] = round(fig["served_tpot_b1_ms"] / fig["epd_tpot_b1_ms"], 3)
        except Exception as e:
            fig["served_error"] = f"{type(e).__name__}: {str(e)[-400:]}"
        save()


def _transformers(cfg: CheckConfig, model: str, dtype: str, fig: dict, save) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    n, b, reps = cfg.perf_tokens, cfg.perf_batch, cfg.perf_repeats
    m = AutoModelForImageTextToText.from_pretrained(model, dtype=getattr(torch, dtype), local_files_only=True)
    m = m.to(cfg.device).eval()
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    tok.padding_side = "left"
    pad = tok.pad_token_id or 0

    def gen(k: int, batch: int = 1) -> None:
        texts = [TEXT] if batch == 1 else [TEXT + f" #{i}" for i in range(batch)]
        x = tok(texts, return_tensors="pt", padding=True).to(cfg.device)
        with torch.inference_mode():
            m.generate(**x, max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None, pad_token_id=pad)

    gen(4)  # warm-up
    tpot, _ = _tpot_ms(gen, n, cfg.device, reps)
    fig["hf_tpot_b1_ms"] = round(tpot, 2)
    save()
    tpot, _ = _tpot_ms(lambda k: gen(k, b), n, cfg.device, max(1, reps - 1))
    fig[f"hf_tpot_b{b}_ms"] = round(tpot, 2)
    fig[f"hf_decode_tok_s_b{b}"] = round(b / tpot * 1e3, 1)
    save()
    del m
    free_device_memory(cfg.device)
