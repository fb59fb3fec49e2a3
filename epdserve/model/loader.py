"""Load a Hugging Face VLM checkpoint directory offline: model, tokenizer, image processor.

The directory is laid out as a downloaded Qwen2-VL-7B-Instruct (config.json, *.safetensors,
tokenizer files, preprocessor_config.json, chat template). Nothing is fetched from a hub, and
torchvision is not needed: the image processor is always transformers' PIL implementation, even
where the config names the fast (torchvision) one, as Qwen3-VL checkpoints do.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# video input (model.video) where the checkpoint has a video_preprocessor_config.json that samples
# frames; the value names whose video processor rules apply
VIDEO_ARCHS = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3", "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2"}
MAX_DEFAULT_CONTEXT = 32768  # the default context is the model's, capped here (KV budget)


@dataclass
class LoadedCheckpoint:
    path: Path
    model: torch.nn.Module  # *ForConditionalGeneration
    tokenizer: object
    image_processor: object
    model_type: str
    video: object = None  # model.video.VideoOptions: the checkpoint's video defaults (None: no video input)


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    without_lm_layers: bool = False) -> LoadedCheckpoint:
    """Load model, tokenizer and image processor from `path` with no network access.

    `without_lm_layers`: transformers builds the model with no decoder layers in its language
    model (their tensors in the files are skipped, never read; engine/lm/shard_loader.py reads them);
    the config still says how many the checkpoint has."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED_ARCHS:
        raise ValueError(f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    if without_lm_layers:
        model = _without_lm_layers(path, config, dtype)
    else:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    video = None
    if config.model_type in VIDEO_ARCHS:
        from epdserve.model.video import VideoOptions

        video = VideoOptions.from_checkpoint(path, VIDEO_ARCHS[config.model_type])
    return LoadedCheckpoint(path, model, tokenizer, image_processor, config.model_type, video)


def _without_lm_layers(path: Path, config, dtype: torch.dtype):
    """The model built from a config with 0 decoder layers; the real counts put back after."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    tc = config.text_config
    if getattr(config, "quantization_config", None) is not None:
        # an FP8 checkpoint's (engine/lm/fp8_checkpoint.py): only decoder-layer projections are quantized
        # (checked before this), and engine/lm/shard_loader.py reads those: transformers builds the rest as is
        del config.quantization_config
    saved = {"num_hidden_layers": tc.num_hidden_layers}
    if getattr(tc, "layer_types", None) is not None:
        saved["layer_types"] = tc.layer_types
    for name, value in saved.items():
        setattr(tc, name, [] if isinstance(value, list) else 0)
    quiet = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would list every skipped layer tensor as unexpected
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)
    finally:
        hf_logging.set_verbosity(quiet)
    for name, value in saved.items():
        for c in (tc, model.config.text_config):  # it may keep a copy
            setattr(c, name, value)
    return model


def max_model_len(text_config, override: int | None = None) -> int:
    """The context length a deployment serves: `override`, else the model's (capped)."""
    return int(override or min(int(text_config.max_position_embeddings), MAX_DEFAULT_CONTEXT))


def eos_token_ids(generation_eos, tokenizer) -> set[int]:
    """The ids that end a generation: generation_config's eos_token_id (int or list) and the tokenizer's."""
    ids: set[int] = set()
    for v in (generation_eos, tokenizer.eos_token_id):
        if isinstance(v, int):
            ids.add(v)
        elif v:
            ids.update(int(x) for x in v)
    return ids
