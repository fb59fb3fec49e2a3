"""`LoadedModel`: one checkpoint loaded once per process and shared by every engine in it.

Co-located stage workers (E+P, E+D, and any later role change) each run their own engine —
own KV cache, scheduler and queue — over this one object: vision tower and language model are
loaded once (on an accelerator a second copy would cost the HBM the KV cache needs). Holds
what depends only on the checkpoint and the context length: the split model (`VLMAdapter`),
tokenizer, multimodal processor, the MM Store namespace of its features and the secret media
keys are keyed with (`seams.media_keys`), EOS ids.
Inference over the shared modules is stateless (per-forward metadata travels as arguments), so
engines on different threads may run forwards at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from epdserve.engine.lm.expert_linears import expert_method
from epdserve.engine.lm.forward import LeanLM
from epdserve.engine.lm.fp8_checkpoint import METHOD as FP8_CHECKPOINT
from epdserve.engine.lm.fp8_checkpoint import Fp8Scheme, check_fp8_tensors, read_fp8_scheme
from epdserve.engine.lm.fp8_device import check_fp8_device
from epdserve.engine.lm.linear import CUDA_CHECKS, check_method
from epdserve.engine.lm.prequantized import CHECKPOINT_ONLY, DESCRIPTION, MIXED, checkpoint_method, read_description
from epdserve.engine.lm.shard_loader import read_layers
from epdserve.ops.npu_quant_schema import check_installed_quant_kernels
from epdserve.engine.tp.shard import TPShard, check_model_degree, num_experts
from epdserve.model.adapter import VLMAdapter
from epdserve.model.loader import LoadedCheckpoint, eos_token_ids, load_checkpoint, max_model_len
from epdserve.model.processor import MultimodalProcessor
from epdserve.platform import get_platform
from epdserve.platform.base import Platform
from epdserve.platform.dtype_default import resolve_dtype
from epdserve.seams.media_keys import MediaKeySecret, namespace_for

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model_id: str
    platform: Platform
    dtype: torch.dtype
    checkpoint: LoadedCheckpoint
    adapter: VLMAdapter
    lm: LeanLM  # the fused LM the engines run (transformers' own LM layers are released)
    processor: MultimodalProcessor
    namespace: str  # MM Store key namespace: features of this vision tower + preprocessing
    media_secret: MediaKeySecret  # what keys media computed here (engine.media_item): the process's
    eos_token_ids: set[int]
    max_model_len: int
    quantization: str = ""  # the LM linears' method (engine/lm/linear.py); "" = dense, in `dtype`
    dtype_why: str = "--dtype"  # why `dtype` (platform/dtype_default.py): given, or what auto saw

    @property
    def dtype_name(self) -> str:
        """`dtype` as the settings spell it ("bfloat16")."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def tokenizer(self):
        return self.checkpoint.tokenizer

    @property
    def device(self) -> torch.device:
        return self.adapter.device


def load_model(model: str, device: str = "auto", dtype: str = "auto", context_len: int | None = None,
               media_secret: MediaKeySecret | None = None, shard: TPShard = TPShard(0, 1),
               quantization: str | None = None) -> LoadedModel:
    """Load `model` (a checkpoint directory) on the platform `device` names ("auto": npu, cuda, cpu).
    `media_secret`: what media keys computed here are keyed with (default: the process's,
    `MediaKeySecret.of_process()`). `shard`: the tensor-parallel rank whose part of the LM's
    decoder layers this process holds (engine/lm/shard_loader.py reads only those slices; a degree that
    does not split the model is refused before any weight is read). `quantization`: how the LM's
    attention and MLP weights are held (engine/lm/linear.py `LINEAR_METHODS`; None: dense, in
    `dtype`); a method the platform has no kernel for is refused before any weight is read (on an NPU
    also an fp32 model, or a torch_npu that does not register the operators the method calls; on CUDA
    an FP8 `_scaled_mm` or the int8 / int4 Triton kernel that does not run on the device).

    dtype "auto" (or None) is bf16 on accelerators and on a CPU with native bf16, else fp32
    (platform/dtype_default.py `auto_dtype`; the choice and why are logged and kept as `dtype_why`)."""
    platform = get_platform(device)
    platform.set_thread_device(_index(device) or 0)  # the loading thread's device
    name, why = resolve_dtype(dtype, platform.name)
    tdtype = _DTYPES[name]
    description = read_description(model) if Path(model).is_dir() else None
    fp8 = read_fp8_scheme(model) if Path(model).is_dir() else None
    quantization = _checkpoint_quantization(model, description, fp8, quantization)
    method = check_method(quantization, platform.name, tdtype)
    if platform.name == "npu" and method != "dense":
        check_installed_quant_kernels(method)  # the operators and keywords the NPU linears call
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) if Path(model).is_dir() else 0
    size = f"{weights / 1e9:.1f} GB" if weights >= 1e9 else f"{weights / 1e6:.1f} MB"
    log.info("loading model %s (%s of weights) on %s as %s (%s) ...", model, size, platform.device(), name, why)
    started = time.monotonic()
    # an FP8 checkpoint's decoder layers are read by the shard loader at every degree (transformers' own
    # expert block, which runs a dense-expert MoE at TP1, reads no FP8): its experts as the files hold them
    own = _check_shard(model, shard, method) or fp8 is not None
    if fp8 is not None:
        check_fp8_tensors(model)
    if method in ("fp8", FP8_CHECKPOINT):
        check_fp8_device(platform.device(), _fp8_layouts(fp8), tdtype)
    if platform.name == "cuda" and method in CUDA_CHECKS:  # the Triton W8A16 / W4A16 kernel, run once on the device
        CUDA_CHECKS[method](platform.device(), tdtype)
    ckpt = load_checkpoint(model, platform.device(), tdtype, without_lm_layers=own)
    a = VLMAdapter(ckpt.model)
    layers = (read_layers(model, a.text_config, shard, tdtype, platform.device(), method, description, fp8=fp8,
                          platform=platform.name) if own else None)
    ctx = max_model_len(a.text_config, context_len)
    processor = MultimodalProcessor(ckpt.tokenizer, ckpt.image_processor, a.image_token_id, a.merge_size, ctx,
                                    a.text_config.vocab_size, video=ckpt.video)
    generation_eos = getattr(getattr(ckpt.model, "generation_config", None), "eos_token_id", None)
    log.info("loaded model %s in %.1f s", model, time.monotonic() - started)
    return LoadedModel(
        model_id=str(model), platform=platform, dtype=tdtype, checkpoint=ckpt, adapter=a,
        lm=LeanLM(a, 2 * max(ctx, a.max_position_embeddings), layers, shard, method, platform.name),
        processor=processor,
        namespace=namespace_for(str(model), a.vision_tower, ckpt.image_processor.to_dict()),
        media_secret=media_secret or MediaKeySecret.of_process(),
        eos_token_ids=eos_token_ids(generation_eos, ckpt.tokenizer), max_model_len=ctx,
        quantization=quantization or "", dtype_why=why,
    )


def _fp8_layouts(scheme: Fp8Scheme | None) -> set[str]:
    """The `_scaled_mm` scale layouts the FP8 projections may run (engine/lm/fp8_linear.py): rowwise,
    and tensorwise too for per-tensor weights with static activations."""
    return {"rowwise"} | ({"tensorwise"} if scheme == Fp8Scheme("tensor", "static") else set())


def _checkpoint_quantization(model: str, desc: dict | None, fp8: Fp8Scheme | None, asked: str | None) -> str | None:
    """The method the LM's linears run: the checkpoint's own when it is quantized already (its
    msModelSlim description `desc`, engine/lm/prequantized.py; its FP8 scheme `fp8`,
    engine/lm/fp8_checkpoint.py), else `asked`; ValueError when both are given and differ."""
    if fp8 is not None:
        if desc:
            raise ValueError(f"{model} has both an FP8 quantization_config and {DESCRIPTION}: which one holds is unclear")
        if asked not in (None, fp8.method):
            raise ValueError(f"{model} holds its language model in FP8 already (config.json quantization_config: "
                             f"runs as {fp8.method}); --quantization {asked} cannot re-quantize it: leave --quantization unset")
        log.info("%s is quantized already (FP8: weights per %s, activations per %s): runs as %s", model,
                 fp8.weights, fp8.activations, fp8.method)
        return fp8.method
    if asked == FP8_CHECKPOINT:
        raise ValueError(f"--quantization {FP8_CHECKPOINT} runs an FP8 checkpoint's own weights, and {model} has no "
                         f"quantization_config: leave --quantization unset, or choose fp8 to quantize at load")
    carried = checkpoint_method(desc) if desc else None
    if carried is None:
        if asked in CHECKPOINT_ONLY:
            raise ValueError(f"--quantization {asked} runs an msModelSlim checkpoint's own quantized weights, and "
                             f"{model} has none ({DESCRIPTION} missing or all FLOAT): leave --quantization unset, or "
                             f"choose int8, w8a8 or int4 to quantize at load")
        return asked
    if asked not in (None, carried, MIXED):
        raise ValueError(f"{model} holds its language model quantized already ({DESCRIPTION}: runs as {carried}); "
                         f"--quantization {asked} cannot re-quantize it: leave --quantization unset")
    log.info("%s is quantized already (%s): its int8 weights run as %s", model, DESCRIPTION, carried)
    return carried


def _check_shard(model: str, shard: TPShard, method: str = "dense") -> bool:
    """Whether engine/lm/shard_loader.py reads the LM's decoder layers (every model, except a sparse one
    at tensor_parallel_size 1 whose experts stay dense under `method`: that keeps transformers' own
    expert block, the oracle's very arithmetic; quantized by a method that quantizes experts, they
    are read and quantized as the projections are, engine/lm/expert_linears.py `expert_method`);
    ValueError for a degree the model cannot take."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(model, local_files_only=True).text_config
    if shard.size > 1:
        check_model_degree(tc, shard.size)
    return not num_experts(tc) or shard.size > 1 or expert_method(method) != "dense"


def _index(device: str) -> int | None:
    """The index in "npu:1" / "cuda:0" (None without one)."""
    _, _, idx = device.partition(":")
    return int(idx) if idx.isdigit() else None
