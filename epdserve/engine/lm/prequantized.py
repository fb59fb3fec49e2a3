"""Checkpoints whose language-model linears are already quantized: msModelSlim's W8A8_DYNAMIC, the
format Ascend users deploy (`--quantization ascend` in vllm-ascend).

msModelSlim writes `quant_model_description.json` beside the safetensors files (vllm-ascend
`quantization/configs/modelslim_config.py`: `MODELSLIM_CONFIG_FILENAME`): one entry per tensor
name, the projection's weight named `<module>.weight` mapped to its type — "W8A8_DYNAMIC",
"W8A8" (static), "W4A8_DYNAMIC", ... or "FLOAT" (not quantized; `get_quant_type_for_layer`) —
beside entries such as "model_quant_type" and "optional" that name no tensor. A W8A8_DYNAMIC
projection holds (vllm-ascend `quantization/methods/w8a8_dynamic.py`,
`AscendW8A8DynamicLinearMethod.get_weight` / `get_perchannel_param` / `apply`):
- `<module>.weight`: int8 [out, in];
- `<module>.weight_scale`: [out, 1], one scale per output channel, in the model's dtype;
- `<module>.weight_offset`: [out, 1]; `apply` never reads it (npu_quant_matmul takes the scale
  alone), so the weights are symmetric: this loader requires it to be zero;
- the activations quantized per token at run time, symmetric int8 (`npu_dynamic_quant`).
That is exactly `--quantization w8a8` (engine/lm/quant_linear.py `Int8DynamicLinear`): such a
checkpoint runs as w8a8 with its own int8 weights and scales, read per rank like float ones
(engine/lm/shard_loader.py).

"W8A16" (the same file's "W8A16量化" section; vllm-ascend `quantization/methods/w8a16.py`
`AscendW8A16LinearMethod`): `weight` int8 [n, k], `weight_scale` ([n] or [n, 1]) and
`weight_offset`, the weights standing for (weight - weight_offset) * weight_scale; with zero offsets
that is `--quantization int8` (`Int8Linear`), and runs as int8. Nonzero offsets are refused: the
msModelSlim document writes (weight - offset) * scale and says the NPU operator computes
(weight + offset) * scale after the loader negates the offset, while vllm-ascend's W8A16 passes
the offset unchanged — which sign a real export wants is not settled here.

"W8A8" (static: engine/lm/static_w8a8.py, `StaticW8A8Linear`): activations quantized per tensor
with the checkpoint's calibrated scale and offset; it runs only from such a checkpoint (method
"w8a8-static"). A checkpoint mixing types (msModelSlim can, e.g. W8A8 with some projections
W8A8_DYNAMIC or FLOAT) runs as "ascend" (vLLM's name for these checkpoints): each projection by its
own type. Other types (W4A8_DYNAMIC, W8A8S, ...) are refused at load, naming the type.

`read_description(path)`: the description, or None for a checkpoint without one;
`checkpoint_method(description)`: the linear method it implies, ValueError for a type epdserve
cannot run; `projection_type(description, name)`: one projection's type.
"""
from __future__ import annotations

import json
from pathlib import Path

DESCRIPTION = "quant_model_description.json"
RUNS_AS = {"W8A8_DYNAMIC": "w8a8", "W8A16": "int8", "W8A8": "w8a8-static"}  # msModelSlim type -> linear method
MIXED = "ascend"  # a checkpoint whose projections are of several types: each runs by its own
CHECKPOINT_ONLY = ("w8a8-static", MIXED)  # methods that need a checkpoint's calibration, never made at load
_NOT_TENSORS = ("model_quant_type", "optional", "version")


def read_description(path: str | Path) -> dict | None:
    f = Path(path) / DESCRIPTION
    if not f.is_file():
        return None
    desc = json.loads(f.read_text())
    if not isinstance(desc, dict):
        raise ValueError(f"{f}: expected a JSON object of tensor name -> quantization type")
    return desc


def projection_type(desc: dict, weight_name: str) -> str:
    """The type of the projection whose weight is `weight_name` ("FLOAT" when not listed)."""
    return str(desc.get(weight_name, "FLOAT"))


def checkpoint_method(desc: dict) -> str | None:
    """The linear method the description's quantized projections need (None: none is quantized;
    MIXED: several types); ValueError naming a type epdserve does not run."""
    types = {str(v) for k, v in desc.items() if k not in _NOT_TENSORS and k.endswith(".weight") and v != "FLOAT"}
    unknown = sorted(types - set(RUNS_AS))
    if unknown:
        raise ValueError(f"the checkpoint's {DESCRIPTION} quantizes projections as {', '.join(unknown)}; epdserve "
                         f"runs msModelSlim's {', '.join(RUNS_AS)} only")
    methods = {RUNS_AS[t] for t in types}
    if len(methods) > 1:
        return MIXED
    return methods.pop() if methods else None
