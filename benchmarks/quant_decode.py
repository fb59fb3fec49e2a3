"""Quantized language-model weights on this machine (issue 49): decode TPOT per method, the bytes
the LM's decoder layers hold, the error against the unquantized model, and each kernel's time
against the model-dtype GEMM per row count.

- `tpot`: the offline `LLM` with `quantization` = none, int8, w8a8, int4, each in a fresh process (its
  own threads and memory), --rounds of them alternated (none, int8, w8a8, int4, none, ...) so a drift of
  the machine hits every method; per process TPOT = (time of N new tokens - time of 1) / (N - 1)
  at each --batch (distinct text prompts, greedy, ignore_eos), --repeats times; median, min and max
  over every repeat, and the ratio of the medians to none's. The same process reports its decoder
  layers' bytes (`LeanLM.layers` tensors).
- `error`: transformers on the checkpoint in --dtype, unquantized against the same weights
  dequantized (int8, int4) and with each projection's input fake-quantized per token (w8a8) — the
  arithmetic tests/engine/test_quantization.py shows the engine's outputs follow; a MoE model's
  experts dequantized per expert, its w8a8 skipped: no hook reaches an expert's input —, teacher-forced
  over --error-tokens tokens the unquantized model generated greedily: the largest absolute logit
  difference and the mean KL(unquantized ‖ quantized) of the next-token distributions.
- `kernels`: one projection of the checkpoint's gate-up shape, each method against the dense
  GEMM at 1, 2, 4, 8, 16, 32, 64, 256 rows (median of 20 calls).

    python benchmarks/quant_decode.py --model DIR --dtype bfloat16 --batch 1 --batch 32 --out quant.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("none", "int8", "w8a8", "int4")


def _decode_tpot():
    """benchmarks/decode_tpot.py's `tpot`, the one TPOT measurement of these scripts (loaded by path)."""
    spec = importlib.util.spec_from_file_location("decode_tpot_bench", Path(__file__).with_name("decode_tpot.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.tpot


def child_tpot(model: str, dtype: str, method: str, batches: list[int], tokens: int, repeats: int) -> dict:
    from epdserve import LLM

    tpot = _decode_tpot()

    llm = LLM(model, device="cpu", dtype=dtype, quantization=None if method == "none" else method)
    lm = llm.engine.model.lm
    layer_bytes = sum(t.numel() * t.element_size() for w in lm.layers for t in w.tensors())
    return {"method": method, "layer_bytes": layer_bytes,
            "tpot_s": {str(b): tpot(llm, b, tokens, repeats) for b in batches}}


def run_tpot(args) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for m in METHODS:
            cmd = [sys.executable, __file__, "--child", m, "--model", args.model, "--dtype", args.dtype,
                   "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            for b in args.batch:
                cmd += ["--batch", str(b)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[m].append(json.loads(out.strip().splitlines()[-1]))
    res = {}
    for b in map(str, args.batch):
        base = statistics.median(t for r in runs["none"] for t in r["tpot_s"][b])
        for m in METHODS:
            ts = [t for r in runs[m] for t in r["tpot_s"][b]]
            med = statistics.median(ts)
            res[f"{m}_batch{b}"] = {"tpot_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
                                    "max_ms": round(max(ts) * 1e3, 2), "tok_s": round(int(b) / med, 1),
                                    "speedup_vs_none": round(base / med, 3)}
    for m in METHODS:
        res[f"{m}_layer_bytes"] = runs[m][0]["layer_bytes"]
    return res


def run_error(args) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from epdserve.engine.lm.int4_linear import dequantize_int4, quantize_int4
    from epdserve.engine.lm.quant_linear import dequantize_int8, quantize_int8, quantize_rows

    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok("Tell me a long story about a dragon and a knight", return_tensors="pt").input_ids
    ref = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype).eval()
    with torch.inference_mode():
        seq = ref.generate(ids, max_new_tokens=args.error_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        want = ref(seq).logits[0, ids.shape[1] - 1:-1].float()
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    out = {}
    for method in ("int8", "w8a8", "int4"):
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype).eval()

        def roundtrip(w):
            return (dequantize_int4(*quantize_int4(w), dtype) if method == "int4"
                    else dequantize_int8(*quantize_int8(w), dtype))
        experts = [m for n, m in model.named_modules() if "visual" not in n and n.endswith("mlp.experts")]
        if experts and method == "w8a8":  # a hook cannot reach transformers' per-expert inputs
            out[method] = {"skipped": "a MoE model's experts' inputs cannot be fake-quantized per expert here"}
            continue
        with torch.no_grad():
            for module in experts:  # a MoE layer's fused [E, out, in] experts, each expert quantized on its own
                for w in (module.gate_up_proj, module.down_proj):
                    w.copy_(torch.stack([roundtrip(e) for e in w]))
        for name, module in model.named_modules():
            if ".layers." in name and "visual" not in name and name.endswith(projections):
                with torch.no_grad():
                    module.weight.copy_(roundtrip(module.weight))
                if method == "w8a8":
                    def fake(_m, a):
                        xq, sx = quantize_rows(a[0].reshape(-1, a[0].shape[-1]))
                        return ((xq.float() * sx).reshape(a[0].shape).to(a[0].dtype),)
                    module.register_forward_pre_hook(fake)
        with torch.inference_mode():
            got = model(seq).logits[0, ids.shape[1] - 1:-1].float()
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1)
        out[method] = {"max_abs_logit_diff": round(float((got - want).abs().max()), 4),
                       "mean_kl": float(f"{float(kl.mean()):.3g}"),
                       "top1_agreement": round(float((got.argmax(-1) == want.argmax(-1)).float().mean()), 4),
                       "logit_range": round(float(want.max() - want.min()), 2)}
        del model
    return {"error_tokens": args.error_tokens, **out}


def run_kernels(args) -> dict:
    import torch
    from transformers import AutoConfig

    from epdserve.engine.lm.linear import make_linear

    tc = AutoConfig.from_pretrained(args.model).text_config
    dtype = getattr(torch, args.dtype)
    w = [torch.randn(tc.intermediate_size, tc.hidden_size, dtype=dtype) * 0.02 for _ in range(2)]
    lins = {m: make_linear(w, method="dense" if m == "none" else m) for m in METHODS}
    res = {}
    for rows in (1, 2, 4, 8, 16, 32, 64, 256):
        x = torch.randn(rows, tc.hidden_size, dtype=dtype)
        for m, lin in lins.items():
            for _ in range(3):
                lin(x)
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                lin(x)
                ts.append(time.perf_counter() - t)
            res.setdefault(str(rows), {})[m] = round(statistics.median(ts) * 1e6, 1)
        base = res[str(rows)]["none"]
        res[str(rows)].update({f"{m}_speedup": round(base / res[str(rows)][m], 2) for m in METHODS[1:]})
    return {"shape": [tc.hidden_size, 2 * tc.intermediate_size], "us_per_call": res}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, action="append", help="decode batch (repeatable; default 1 and 32)")
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--error-tokens", type=int, default=256)
    ap.add_argument("--parts", default="kernels,tpot,error", help="comma-separated: kernels, tpot, error")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batch = args.batch or [1, 32]
    if args.child:
        print(json.dumps(child_tpot(args.model, args.dtype, args.child, args.batch, args.tokens, args.repeats)))
        return
    res = {"model": args.model, "dtype": args.dtype}
    parts = args.parts.split(",")
    for name, fn in (("kernels", run_kernels), ("tpot", run_tpot), ("error", run_error)):
        if name in parts:
            res[name] = fn(args)
            print(json.dumps({name: res[name]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
