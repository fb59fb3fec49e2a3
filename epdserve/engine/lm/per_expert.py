"""MoE experts stored one module per expert — the layout of the FP8 Qwen3-VL-MoE checkpoints
deployed — read per rank into per-expert projections (issue 49).

transformers 5 and the bf16 hub checkpoints fuse a layer's experts into [E, ...] tensors
(engine/lm/shard_loader.py `_experts` reads those). The FP8 checkpoints instead hold each expert's
three projections as their own Linear modules, under `<layer>.mlp.experts.{e}.{gate,up,down}_proj`:

- compressed-tensors (llm-compressor, e.g. RedHatAI's FP8-dynamic models): llm-compressor replaces
  the fused block by `CalibrateQwen3VLMoeTextSparseMoeBlock` (src/llmcompressor/modeling/
  qwen3_vl_moe.py, `is_permanent = True`), whose `SequentialQwen3VLMoeTextExperts` is one
  `Qwen3VLMoeTextMLP` per expert (gate_proj, up_proj, down_proj nn.Linear, [out, in]); each is
  quantized as any Linear, so it is saved as `weight` float8_e4m3fn + `weight_scale` (and
  `input_scale` for static activations): engine/lm/fp8_checkpoint.py's per-projection format.
- Qwen's own block-wise FP8 (`"quant_method": "fp8"`, weight_block_size [128, 128]): the same
  per-expert modules with `weight` float8_e4m3fn + `weight_scale_inv` per block. Seen in the
  loaders written for Qwen's FP8 MoE releases (ml-explore/mlx-lm pull 1224, for
  Qwen/Qwen3.6-35B-A3B-FP8: `experts.{E}.{gate,up,down}_proj.weight` and a `weight_scale_inv` each,
  where the bf16 release is pre-stacked), not in Qwen3-VL-30B-A3B-Instruct-FP8's own index, which
  was not read here.

Both are what vLLM reads: `Qwen3MoeModel.load_weights` (vllm/model_executor/models/qwen3_moe.py,
used by qwen3_vl_moe.py's language model) maps a per-expert name through
`FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name=
"down_proj", ckpt_up_proj_name="up_proj", num_experts)`: `experts.{e}.gate_proj.` / `up_proj.` ->
`experts.w13_` (shards w1 / w3) and `experts.{e}.down_proj.` -> `experts.w2_`, so `weight`,
`weight_scale`, `weight_scale_inv` and `input_scale` of each expert land in the fused-MoE
method's per-expert slots (fp8.py `Fp8MoEMethod.create_weights`, compressed_tensors_moe.py); its
fused-name path (`is_fused_expert`: `experts.gate_up_proj`, `experts.down_proj`) is the bf16
layout's. transformers' FP8 experts (integrations/finegrained_fp8.py `FP8Experts`) hold fused
`gate_up_proj` [E, 2 I, hidden] with `gate_up_proj_scale_inv` [E, ceil(2 I / bn), ceil(hidden / bk)];
a checkpoint stored so is refused (engine/lm/fp8_checkpoint.py `check_fp8_tensors`): not read yet.

`read_fp8_experts` builds, for each of the rank's experts (engine/tp/shard.py `expert_range`), one
gate-up projection fusing gate_proj and up_proj (gate's rows first, as transformers' gate_up) and
one down projection, FP8 by the checkpoint's scheme (engine/lm/fp8_parts.py). Experts the
checkpoint left in float (its ignore list) are stacked into transformers' fused layout
(`stack_float_experts`) and held by the method the fused ones take. All of a layer's experts must
be one or the other (`holds_fp8_experts` refuses a mix, naming a projection).
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fp8_checkpoint import Fp8Scheme
from epdserve.engine.lm.fp8_parts import read_fp8
from epdserve.engine.lm.linear import Linear

FP8_DTYPE = "F8_E4M3"  # the safetensors header's name for float8_e4m3fn


def per_expert_name(p: str, e: int, proj: str) -> str:
    """Expert e's `proj` ("gate_proj", "up_proj", "down_proj") weight under layer prefix `p`."""
    return f"{p}mlp.experts.{e}.{proj}.weight"


def stores_per_expert(reader, p: str, first: int) -> bool:
    """Whether the layer under `p` holds its experts one module each (expert `first`'s gate_proj is there)."""
    return per_expert_name(p, first, "gate_proj") in reader


def holds_fp8_experts(reader, p: str, experts: range) -> bool:
    """Whether `experts` of the layer under `p` are FP8 (all of them) or float (none); ValueError for
    a mix, KeyError for a projection missing."""
    names = [per_expert_name(p, e, m) for e in experts for m in ("gate_proj", "up_proj", "down_proj")]
    missing = [n for n in names if n not in reader]
    if missing:
        raise KeyError(f"the checkpoint has no tensor {missing[0]!r} (its experts are stored one module each)")
    fp8 = {n for n in names if reader.dtype(n) == FP8_DTYPE}
    if fp8 and len(fp8) != len(names):
        raise ValueError(f"{p}mlp.experts: some expert projections are FP8 and some are not (e.g. "
                         f"{sorted(set(names) - fp8)[0]} is not); epdserve holds a layer's experts all one way")
    return bool(fp8)


def read_fp8_experts(reader, p: str, experts: range, scheme: Fp8Scheme | None, dtype: torch.dtype,
                     device) -> tuple[list[Linear], list[Linear]]:
    """(gate-up projections, down projections) of the FP8 `experts` of the layer under `p`, one each
    per expert, read by `scheme` (the checkpoint's: ValueError without one)."""
    if scheme is None:
        raise ValueError(f"{p}mlp.experts hold FP8 weights but config.json has no FP8 quantization_config")
    gate_up, down = [], []
    for e in experts:
        parts = [(f"mlp.experts.{e}.gate_proj", None, None), (f"mlp.experts.{e}.up_proj", None, None)]
        gate_up.append(read_fp8(reader, p, parts, [None, None], dtype, device, scheme))
        down.append(read_fp8(reader, p, [(f"mlp.experts.{e}.down_proj", None, None)], [None], dtype, device, scheme))
    return gate_up, down


def stack_float_experts(reader, p: str, experts: range, dtype: torch.dtype,
                        device) -> tuple[torch.Tensor, torch.Tensor]:
    """The float `experts` of the layer under `p` in transformers' fused layout: (gate_up
    [E_local, 2 I, hidden], down [E_local, hidden, I]), in `dtype` on `device`."""
    def get(e, m):
        return reader.get(per_expert_name(p, e, m)).to(device=device, dtype=dtype)

    gate_up = torch.stack([torch.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in experts])
    return gate_up, torch.stack([get(e, "down_proj") for e in experts])
