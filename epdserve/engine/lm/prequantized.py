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
(engine/lm/shard_loader.py). Other quantized types are refused at load, naming the type.

`read_description(path)`: the description, or None for a checkpoint without one;
`checkpoint_method(description)`: the linear method it implies ("w8a8"), ValueError for a type
epdserve cannot run; `projection_type(description, name)`: one projection's type.
"""
from __future__ import annotations

import json
from pathlib import Path

DESCRIPTION = "quant_model_description.json"
RUNS_AS = {"W8A8_DYNAMIC": "w8a8"}  # msModelSlim type -> the linear method that computes it
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
    """The linear method the description's quantized projections need (None: none is quantized);
    ValueError naming a type epdserve does not run, or a mix of types."""
    types = {str(v) for k, v in desc.items() if k not in _NOT_TENSORS and k.endswith(".weight") and v != "FLOAT"}
    unknown = sorted(types - set(RUNS_AS))
    if unknown:
        raise ValueError(f"the checkpoint's {DESCRIPTION} quantizes projections as {', '.join(unknown)}; epdserve "
                         f"runs msModelSlim's {', '.join(RUNS_AS)} only (as --quantization "
                         f"{', '.join(sorted(set(RUNS_AS.values())))})")
    methods = {RUNS_AS[t] for t in types}
    return methods.pop() if methods else None
