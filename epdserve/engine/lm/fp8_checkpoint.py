"""FP8 checkpoints: what config.json's `quantization_config` says, and which of its forms epdserve runs.

The FP8 checkpoints deployed for Qwen2.5-VL / Qwen3-VL are llm-compressor's (e.g. RedHatAI's
"-FP8-Dynamic" models), in the compressed-tensors format; vLLM reads them as
`quantization="compressed-tensors"` (vllm/model_executor/layers/quantization/compressed_tensors/
compressed_tensors.py: `CompressedTensorsConfig.from_config` reads "config_groups", "ignore",
"format", "kv_cache_scheme"; `_get_scheme_from_parts`: `_is_fp8_w8a8` accepts weights {"type":
"float", "num_bits": 8, "symmetric": true, "dynamic": false, "strategy": "tensor" | "channel"}
with activations of type "float", and builds `CompressedTensorsW8A8Fp8(weight_quant,
is_static_input_scheme=input_quant and not input_quant.dynamic)`;
schemes/compressed_tensors_w8a8_fp8.py: `__init__` quantizes dynamic activations per token
(`GroupShape.PER_TOKEN`, whatever their "strategy") and static ones per tensor;
`create_weights`: each
quantized Linear holds `weight` float8_e4m3fn [out, in], `weight_scale` fp32 — [out, 1]
(ChannelQuantScaleParameter) or one value (PerTensorScaleParameter) — and, for static
activations, `input_scale` (one value)). The weights stand for weight · weight_scale.

    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
      "ignore": ["lm_head", "re:visual.*"], "kv_cache_scheme": null}

(newer compressed-tensors may give each group its own "format", the top-level one then being
"mixed-precision": each group's must be "float-quantized").

Which projections are quantized is read from the files themselves: a LM decoder projection whose
weight is float8_e4m3fn is FP8 (the config's "targets" / "ignore" chose them when it was written),
any other is dense. MoE experts stored one module each (`mlp.experts.{e}.{gate,up,down}_proj`, the
layout of the FP8 Qwen3-VL-MoE checkpoints: engine/lm/per_expert.py) are projections like any other.
An FP8 tensor anywhere else (vision tower, embedding, LM head, the router, experts fused into
[E, ...] tensors as transformers' `FP8Experts` holds them) is refused at start-up
(`check_fp8_tensors`): epdserve runs FP8 in the LM's attention, dense MLP and per-expert projections.

Qwen's and DeepSeek's own block-wise FP8 (`"quant_method": "fp8"`, `"weight_block_size": [128,
128]`, `"activation_scheme": "dynamic"`; transformers integrations/finegrained_fp8.py `FP8Linear`
holds `weight_scale_inv` per block; vLLM fp8.py `Fp8Config.from_config` reads
"activation_scheme", "weight_block_size") runs as "fp8" (vLLM's name): engine/lm/fp8_block_linear.py.

Refused at start-up, naming why: a compressed-tensors scheme other than the above (int8 /
int4 "pack-quantized" / "int-quantized" formats, group or block strategies, asymmetric or
weight-only FP8, several groups with different schemes, an FP8 KV cache scheme); "fp8" without
weight_block_size (per-tensor), with static activations or another fmt; any other quant_method.

Dynamic activations run per token here too, as in vLLM, whether the config says "token" or
"tensor": one scale over a whole step's tokens would make a request's output depend on the other
requests batched with it.

`read_fp8_scheme(path)`: the `Fp8Scheme` (weights "tensor" | "channel" | "block"; activations
"token" (dynamic) | "static" | "group"), None without a quantization_config, ValueError otherwise.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

METHOD = "compressed-tensors"  # vLLM's name for these checkpoints; the linear method they run as
BLOCK_METHOD = "fp8"  # block-wise ("quant_method": "fp8" with weight_block_size): vLLM's name
PROJECTION = re.compile(
    r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")


@dataclass(frozen=True)
class Fp8Scheme:
    weights: str  # "tensor": one weight_scale a projection; "channel": one per output row; "block": weight_scale_inv
    activations: str  # "token": per token at run time; "static": per tensor, the checkpoint's input_scale;
    # "group": per token and group of block[1] inputs at run time
    block: tuple[int, int] | None = None  # "block": weight_block_size [rows, inputs]

    @property
    def method(self) -> str:
        """The linear method such a checkpoint runs as (vLLM's name for its quant_method)."""
        return BLOCK_METHOD if self.weights == "block" else METHOD


def read_fp8_scheme(path: str | Path) -> Fp8Scheme | None:
    """The FP8 scheme config.json's `quantization_config` describes (module docstring); None if it has none."""
    f = Path(path) / "config.json"
    qc = json.loads(f.read_text()).get("quantization_config") if f.is_file() else None
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _block_wise(path, qc)
    if method != METHOD:
        raise ValueError(f"{path}: quantization_config quant_method {method!r} is not supported; epdserve runs "
                         f"{METHOD} FP8 checkpoints (and msModelSlim's, by quant_model_description.json)")
    return _compressed_tensors(path, qc)


def _block_wise(path, qc: dict) -> Fp8Scheme:
    """Qwen's / DeepSeek's block-wise FP8 (engine/lm/fp8_block_linear.py): {"quant_method": "fp8",
    "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]} (transformers
    utils/quantization_config.py `FineGrainedFP8Config`; vLLM fp8.py `Fp8Config.from_config`)."""
    block = qc.get("weight_block_size")
    if not block:
        raise ValueError(f"{path}: quant_method 'fp8' without weight_block_size (per-tensor) is not supported yet; "
                         f"epdserve runs block-wise 'fp8' and compressed-tensors FP8 checkpoints")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{path}: weight_block_size must be two positive integers, got {block!r}")
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{path}: block-wise FP8 runs with fmt 'e4m3' and activation_scheme 'dynamic' only (got "
                         f"{qc.get('fmt')!r}, {qc.get('activation_scheme')!r})")
    return Fp8Scheme("block", "group", (block[0], block[1]))


def _compressed_tensors(path, qc: dict) -> Fp8Scheme:
    def refuse(why: str) -> ValueError:
        return ValueError(f"{path}: compressed-tensors {why}; epdserve runs FP8 W8A8 only (weights float 8-bit, "
                          f"symmetric, static, per tensor or per channel; activations float 8-bit, dynamic per "
                          f"token or per tensor, or static per tensor)")

    if qc.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme (an FP8 KV cache) is not supported")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise refuse("config without config_groups")
    for g in groups:  # a group's own "format" (the top-level one is then "mixed-precision") else the config's
        fmt = g.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise refuse(f"format {fmt!r} (not 'float-quantized')")
    schemes = {_group_scheme(g, refuse) for g in groups}
    if len(schemes) > 1:
        raise refuse(f"groups of different schemes ({sorted(map(str, schemes))})")
    return schemes.pop()


def _group_scheme(group: dict, refuse) -> Fp8Scheme:
    w, a = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations"):
        raise refuse("output_activations quantization")
    if not (w.get("num_bits") == 8 and w.get("type") == "float"):
        raise refuse(f"weights of {w.get('num_bits')} bits, type {w.get('type')!r}")
    if w.get("strategy") == "block" or w.get("block_structure"):
        raise ValueError("compressed-tensors block-wise FP8 (block_structure / strategy 'block') is not supported "
                         "yet (block-wise 'quant_method': 'fp8' checkpoints are)")
    if w.get("strategy") not in ("tensor", "channel"):
        raise refuse(f"weight strategy {w.get('strategy')!r}")
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise refuse("asymmetric or dynamic weights")
    if not a:
        raise refuse("weight-only FP8 (no input_activations)")
    if not (a.get("num_bits") == 8 and a.get("type") == "float") or not a.get("symmetric", True):
        raise refuse(f"input activations of {a.get('num_bits')} bits, type {a.get('type')!r}, "
                     f"symmetric {a.get('symmetric', True)}")
    strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
    if dynamic and strategy in ("token", "tensor"):
        return Fp8Scheme(w["strategy"], "token")  # per token, as vLLM runs either (module docstring)
    if strategy == "tensor":
        return Fp8Scheme(w["strategy"], "static")
    raise refuse(f"input activation strategy {strategy!r} (dynamic {dynamic})")


def check_fp8_tensors(path: str | Path) -> None:
    """ValueError naming an FP8 tensor outside the LM decoder's attention, dense MLP and per-expert
    MoE projections, or one not float8_e4m3fn (e5m2)."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                dtype = h.get_slice(name).get_dtype()
                if dtype.startswith("F8") and dtype != "F8_E4M3":
                    raise ValueError(f"{path}: {name} is {dtype}; epdserve runs float8_e4m3fn (F8_E4M3) weights only")
                if dtype.startswith("F8") and (
                        not PROJECTION.search(name) or "visual" in name):
                    raise ValueError(f"{path}: {name} is FP8; epdserve runs FP8 only in the language model's "
                                     f"attention, dense MLP and MoE expert projections, the experts stored one "
                                     f"module each (mlp.experts.<e>.<gate|up|down>_proj; the vision tower, "
                                     f"embedding, LM head and router must be in the checkpoint's ignore list)")
