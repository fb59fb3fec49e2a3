"""The language model's decoder layers read straight from a checkpoint's safetensors files, each
rank reading only its own slices (issue 47 item 5).

transformers builds the rest of the model (vision tower, embedding, final norm, LM head, rotary
tables: `model/loader.py load_checkpoint(..., without_lm_layers=True)`); the decoder layers, most of the
weights, are never built as transformers modules. For layer i this reads, memory-mapped
(`safe_open(...).get_slice`): the rank's rows of q/k/v (its query heads, its KV heads) and
their biases, the rank's input columns of o_proj, its rows of gate/up and input columns of
down_proj (`engine/tp/shard.py` `head_map`, the MLP split in tp equal parts), and the norms
whole. Nothing outside those slices is read into memory, on any rank (tests/engine/
test_shard_loader.py counts every tensor the reader hands out). The slices are converted to the
model dtype (an FP8 checkpoint's float8 weights and their scales as they are, engine/lm/fp8_checkpoint.py)
and handed to the linear-layer contract (`engine/lm/linear.py` `make_linear`: the rank's
slices of QKV, of gate-up, of o and of down, each fused and held as its method holds them on the
engine's platform: `platform`, "npu" for torch_npu's kernels, engine/lm/linear.py `linear_class`).

Both layouts of the checkpoints in the wild are read: transformers 5's
(`model.language_model.layers.N.`) and the hub's Qwen2-VL / Qwen2.5-VL one (`model.layers.N.`),
as transformers' own key mapping renames them. A sparse (MoE) layer's router is read whole and
only the rank's experts of its fused expert tensors (engine/lm/experts.py), held by the same method
as the projections (engine/lm/expert_linears.py); an FP8 checkpoint's experts, one module each, as
the checkpoint holds them (engine/lm/per_expert.py; its FP8 readers: engine/lm/fp8_parts.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from epdserve.engine.lm.expert_linears import check_expert_groups, expert_method
from epdserve.engine.lm.experts import ExpertShard
from epdserve.engine.lm.fp8_checkpoint import Fp8Scheme
from epdserve.engine.lm.fp8_parts import read_fp8
from epdserve.engine.lm.linear import Linear, linear_class, make_linear, static_linear
from epdserve.engine.lm.per_expert import holds_fp8_experts, read_fp8_experts, stack_float_experts, stores_per_expert
from epdserve.engine.lm.prequantized import projection_type
from epdserve.engine.lm.static_w8a8 import StaticPart
from epdserve.engine.lm.weights import LeanLayerWeights
from epdserve.engine.tp.shard import TPShard, expert_range, head_map, sparse_layer

_PREFIXES = ("model.language_model.layers.{}.", "model.layers.{}.")


class SafetensorsReader:
    """A checkpoint's tensors by name across its safetensors files, memory-mapped: `get` reads a
    tensor or a range of its rows or columns, nothing more."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
            else sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> list[int]:
        return self._where[name].get_slice(name).get_shape()

    def dtype(self, name: str) -> str:
        """The tensor's dtype as the file spells it ("BF16", "F8_E4M3", ...), read from its header."""
        return self._where[name].get_slice(name).get_dtype()

    def get(self, name: str, rows: range | None = None, cols: range | None = None) -> torch.Tensor:
        """The tensor `name`, or only `rows` (of dim 0) / `cols` (of dim 1) of it."""
        try:
            h = self._where[name]
        except KeyError:
            raise KeyError(f"the checkpoint has no tensor {name!r}") from None
        if rows is None and cols is None:
            return h.get_tensor(name)
        sl = h.get_slice(name)
        if cols is None:
            return sl[rows.start:rows.stop]
        return sl[:, cols.start:cols.stop] if rows is None else sl[rows.start:rows.stop, cols.start:cols.stop]


def layer_prefix(reader: SafetensorsReader, i: int) -> str:
    for p in _PREFIXES:
        if p.format(i) + "input_layernorm.weight" in reader:
            return p.format(i)
    raise KeyError(f"the checkpoint has no decoder layer {i} (looked for {', '.join(p.format(i) for p in _PREFIXES)})")


def read_layer(reader: SafetensorsReader, i: int, text_config, shard: TPShard, dtype: torch.dtype,
               device: torch.device | str, method: str = "dense", description: dict | None = None,
               fp8: Fp8Scheme | None = None, platform: str = "cpu") -> LeanLayerWeights:
    """Decoder layer i's lean weights, `shard`'s part of them (see the module docstring); with an
    msModelSlim `description` (engine/lm/prequantized.py) its quantized projections are read as
    they are (int8 weights, their scales) and the rest held dense; likewise a compressed-tensors
    FP8 checkpoint's (`fp8`: its scheme, engine/lm/fp8_checkpoint.py) float8 projections."""
    p = layer_prefix(reader, i)
    H, KVH = text_config.num_attention_heads, text_config.num_key_value_heads
    d = getattr(text_config, "head_dim", None) or text_config.hidden_size // H
    q, kv = head_map(H, KVH, shard)
    qr, kr = range(q.start * d, q.stop * d), range(kv.start * d, kv.stop * d)
    part = text_config.intermediate_size // shard.size
    mlp = range(shard.rank * part, (shard.rank + 1) * part)

    def get(name, rows=None, cols=None, optional=False):
        if optional and p + name not in reader:
            return None
        return reader.get(p + name, rows, cols).to(device=device, dtype=dtype)

    def linear(parts, biases=None):
        """One projection fusing `parts` ((module, rows, cols) each: the rank's slice)."""
        if fp8 is not None:
            kinds = {"FP8" if reader.dtype(p + m + ".weight") == "F8_E4M3" else "" for m, _, _ in parts}
        else:
            kinds = {projection_type(description, p + m + ".weight") if description else "" for m, _, _ in parts}
        if len(kinds) > 1:
            raise ValueError(f"{p}: the parts {[m for m, _, _ in parts]} are quantized differently ({sorted(kinds)})")
        if kinds == {"W8A8_DYNAMIC"}:
            return _w8a8_dynamic(reader, p, parts, biases or [None] * len(parts), dtype, device, platform)
        if kinds == {"W8A16"}:
            return _w8a16(reader, p, parts, biases or [None] * len(parts), dtype, device, platform)
        if kinds == {"FP8"}:
            return read_fp8(reader, p, parts, biases or [None] * len(parts), dtype, device, fp8)
        if kinds == {"W8A8"}:  # split by its inputs (o, down): the ranks' sums add up, rank 0 adds quant_bias
            return _w8a8_static(reader, p, parts, dtype, device, platform,
                                bias_here=shard.rank == 0 or parts[0][2] is None)
        return make_linear([get(m + ".weight", r, c).contiguous() for m, r, c in parts], biases,
                           "dense" if description or fp8 else method, platform)

    qkv = linear([("self_attn.q_proj", qr, None), ("self_attn.k_proj", kr, None), ("self_attn.v_proj", kr, None)],
                 [get(f"self_attn.{n}_proj.bias", r, optional=True) for n, r in (("q", qr), ("k", kr), ("v", kr))])
    o_bias = get("self_attn.o_proj.bias", optional=True) if shard.rank == 0 else None  # the sum counts it once
    o = linear([("self_attn.o_proj", None, qr)], [o_bias])
    if sparse_layer(text_config, i):
        gate_up = down = None
        held = expert_method(method, prequantized=bool(description) or fp8 is not None)
        moe = _experts(reader, p, text_config, shard, get, held, platform, fp8, dtype, device)
    else:
        gate_up = linear([("mlp.gate_proj", mlp, None), ("mlp.up_proj", mlp, None)])
        down, moe = linear([("mlp.down_proj", None, mlp)]), None
    return LeanLayerWeights(
        qkv=qkv, o=o, input_norm=get("input_layernorm.weight"), post_norm=get("post_attention_layernorm.weight"),
        q_norm=get("self_attn.q_norm.weight", optional=True), k_norm=get("self_attn.k_norm.weight", optional=True),
        gate_up=gate_up, down=down, moe=moe)


def _w8a8_dynamic(reader: SafetensorsReader, p: str, parts, biases, dtype, device, platform: str) -> Linear:
    """msModelSlim W8A8_DYNAMIC parts (engine/lm/prequantized.py): the rank's slice of each int8
    weight and the scales of its output rows (all of them for a projection split by its inputs)."""
    qs, scales = [], []
    for m, rows, cols in parts:
        offset = reader.get(p + m + ".weight_offset", rows)
        if bool(offset.ne(0).any()):
            raise ValueError(f"{p}{m}.weight_offset is not zero: asymmetric int8 weights are not supported "
                             f"(vllm-ascend's W8A8_DYNAMIC never applies it either)")
        q = reader.get(p + m + ".weight", rows, cols)
        if q.dtype != torch.int8:
            raise ValueError(f"{p}{m}.weight is {q.dtype}, expected int8 for W8A8_DYNAMIC")
        qs.append(q.to(device).contiguous())
        scales.append(reader.get(p + m + ".weight_scale", rows).to(device=device, dtype=dtype))
    return linear_class("w8a8", platform).prequantized(qs, scales, biases, dtype)


def _int8_parts(reader: SafetensorsReader, p: str, parts, kind: str, device) -> list[torch.Tensor]:
    """The rank's slice of each part's int8 weight; ValueError for another dtype."""
    out = []
    for m, rows, cols in parts:
        q = reader.get(p + m + ".weight", rows, cols)
        if q.dtype != torch.int8:
            raise ValueError(f"{p}{m}.weight is {q.dtype}, expected int8 for {kind}")
        out.append(q.to(device).contiguous())
    return out


def _w8a16(reader: SafetensorsReader, p: str, parts, biases, dtype, device, platform: str) -> Linear:
    """msModelSlim W8A16 parts (engine/lm/prequantized.py): int8 weights and per-channel scales,
    zero offsets (refused otherwise: which sign a nonzero one takes is not settled)."""
    scales = []
    for m, rows, _ in parts:
        if bool(reader.get(p + m + ".weight_offset", rows).ne(0).any()):
            raise ValueError(f"{p}{m}.weight_offset is not zero: asymmetric W8A16 weights are not supported "
                             f"(msModelSlim's document and vllm-ascend disagree on the offset's sign)")
        scales.append(reader.get(p + m + ".weight_scale", rows).to(device=device, dtype=dtype).reshape(-1))
    return linear_class("int8", platform).prequantized(_int8_parts(reader, p, parts, "W8A16", device), scales,
                                                       biases, dtype)


def _w8a8_static(reader: SafetensorsReader, p: str, parts, dtype, device, platform: str, bias_here: bool) -> Linear:
    """msModelSlim static W8A8 parts (engine/lm/static_w8a8.py): the rank's slice of each int8 weight,
    the deq_scale and quant_bias of its output rows (all of them for a projection split by its inputs,
    where only rank 0 adds quant_bias: `bias_here`), one input scale and offset per part."""
    qs = _int8_parts(reader, p, parts, "W8A8", device)
    out = []
    for (m, rows, _), q in zip(parts, qs):
        name = p + m
        deq = reader.get(name + ".deq_scale", rows)
        if deq.dtype != torch.float32:
            raise ValueError(f"{name}.deq_scale is {deq.dtype}: only a bf16 export's float32 deq_scale is read (an "
                             f"fp16 export's int64 encoding for the NPU operator is not)")
        scale, offset = reader.get(name + ".input_scale").float(), reader.get(name + ".input_offset").float()
        if scale.numel() != 1 or offset.numel() != 1 or not float(scale.reshape(-1)[0]) > 0:
            raise ValueError(f"{name}: input_scale and input_offset must be one value each, the scale > 0 (got shapes "
                             f"{tuple(scale.shape)} and {tuple(offset.shape)})")
        bias = reader.get(name + ".quant_bias", rows) if bias_here else None
        if bias is not None and bias.dtype != torch.int32:
            raise ValueError(f"{name}.quant_bias is {bias.dtype}, expected int32")
        if deq.reshape(-1).shape[0] != q.shape[0] or (bias is not None and bias.reshape(-1).shape[0] != q.shape[0]):
            raise ValueError(f"{name}: deq_scale / quant_bias do not have one value per output row ({q.shape[0]})")
        out.append(StaticPart(q, float(scale.reshape(-1)[0]), int(round(float(offset.reshape(-1)[0]))),
                              deq.to(device).reshape(-1), None if bias is None else bias.to(device).reshape(-1)))
    return static_linear(out, dtype, platform)


def _experts(reader: SafetensorsReader, p: str, text_config, shard: TPShard, get, method: str,
             platform: str = "cpu", fp8: Fp8Scheme | None = None, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> ExpertShard:
    """A sparse layer's router (whole, in the model dtype) and the rank's experts (`expert_range`),
    each held by `method` as the dense linears are (engine/lm/expert_linears.py: an int4 model whose
    expert widths are not whole groups is refused before they are read), in transformers
    5's layout: gate_up [E, 2 I, hidden], down [E, hidden, I]. Checkpoints written before it
    hold both transposed ([E, hidden, 2 I], [E, I, hidden]): read by shape, as transformers'
    own conversion does (conversion_mapping.py "qwen3_vl_moe": Transpose(1, 2, check_dims=True),
    which keeps a tensor already of the expected shape). Experts stored one module each (the FP8
    checkpoints' layout, engine/lm/per_expert.py) are read as they are when FP8 (`fp8`: the
    checkpoint's scheme), else stacked into that fused layout and held by `method`."""
    h, inter = text_config.hidden_size, text_config.moe_intermediate_size
    mine = expert_range(text_config.num_experts, shard)
    if stores_per_expert(reader, p, mine.start):
        if holds_fp8_experts(reader, p, mine):
            gate_up, down = read_fp8_experts(reader, p, mine, fp8, dtype, device)
            return ExpertShard.of_projections(get("mlp.gate.weight"), gate_up, down, mine.start,
                                              text_config.num_experts_per_tok, fp8.method)
        gate_up, down = stack_float_experts(reader, p, mine, dtype, device)
        return ExpertShard(get("mlp.gate.weight"), gate_up, down, mine.start, text_config.num_experts_per_tok,
                           method, platform)
    check_expert_groups(method, {"gate_up_proj (hidden_size)": h, "down_proj (moe_intermediate_size)": inter})

    def experts(name: str, want: tuple[int, int]) -> torch.Tensor:
        shape = tuple(reader.shape(p + name)[1:])
        t = get(name, mine)
        if shape == want:
            return t
        if shape == want[::-1]:
            return t.transpose(1, 2).contiguous()
        raise ValueError(f"{p}{name}: expert shape {shape}, expected {want} or {want[::-1]}")

    return ExpertShard(get("mlp.gate.weight"), experts("mlp.experts.gate_up_proj", (2 * inter, h)),
                       experts("mlp.experts.down_proj", (h, inter)), mine.start, text_config.num_experts_per_tok,
                       method, platform)


def read_layers(path: str | Path, text_config, shard: TPShard, dtype: torch.dtype,
                device: torch.device | str, method: str = "dense", description: dict | None = None,
                fp8: Fp8Scheme | None = None, platform: str = "cpu") -> list[LeanLayerWeights]:
    """Every decoder layer's lean weights, `shard`'s part, projections held by `method` (or, given an
    msModelSlim checkpoint's `description` or an FP8 checkpoint's scheme `fp8`, as it says:
    engine/lm/prequantized.py, engine/lm/fp8_checkpoint.py)."""
    reader = SafetensorsReader(path)
    return [read_layer(reader, i, text_config, shard, dtype, device, method, description, fp8, platform)
            for i in range(text_config.num_hidden_layers)]
