"""Random-weight demo checkpoints laid out like a downloaded Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE).

Owns: the `tiny`, `small` and `2b` size presets (`2b`: Qwen2-VL-2B's shapes, demo vocabulary,
random weights; Qwen2-VL / Qwen2.5-VL only: the device check's decode timings), `build_demo_model` (config + fp32 safetensors +
generation config + offline tokenizer and chat template + image-processor config in one
directory) and the `epdserve demo-model` CLI subcommand (`add_parser` / `run` / `main`). The
Qwen3 family's shapes and preprocessor files live in `demo_qwen3`.

Weights are re-drawn with std 1.5/sqrt(fan_in) (the default 0.02 init makes a model that
repeats one token), so greedy outputs depend on the prompt and on the images. The same
arguments always give byte-identical files.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass

from epdserve.model.demo_qwen3 import QWEN3_ARCHS, QWEN3_PRESETS, qwen3_config, qwen3_preprocessor_files

ARCHS = ("qwen2_vl", "qwen2_5_vl", *QWEN3_ARCHS)
SIZES = ("tiny", "small", "small-d128", "2b")

# A 448x448 image → 32x32 patches of 14 px → 256 tokens after the 2x2 merge; 56x56 is the
# smallest image (2x2 patches, one token); big images are capped at 1280 tokens.
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


@dataclass(frozen=True)
class DemoSize:
    """Shape of one size preset (language model + vision tower)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    mrope_section: tuple[int, int, int]
    vit_width: int
    vit_depth: int
    vit_heads: int
    vit_intermediate: int  # Qwen2.5-VL's SwiGLU width; Qwen2-VL uses mlp_ratio 4


PRESETS = {
    "tiny": DemoSize(vocab=2000, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                     mrope_section=(2, 3, 3), vit_width=32, vit_depth=2, vit_heads=2,
                     vit_intermediate=96),
    "small": DemoSize(vocab=9000, hidden=512, layers=8, heads=8, kv_heads=2, intermediate=3584,
                      mrope_section=(8, 12, 12), vit_width=512, vit_depth=8, vit_heads=8,
                      vit_intermediate=1536),
    # the small model with head_dim 128 (4 heads of 128, not 8 of 64): the head size op-plugin's TND attention
    # docs list (D = 128 or 192), for the NPU first run's PD step (scripts/npu_first_run.sh)
    "small-d128": DemoSize(vocab=9000, hidden=512, layers=8, heads=4, kv_heads=2, intermediate=3584,
                           mrope_section=(16, 24, 24), vit_width=512, vit_depth=8, vit_heads=8,
                           vit_intermediate=1536),
    # Qwen2-VL-2B's shapes (LM 1536 x 28 layers, 12 heads / 2 KV heads, MLP 8960; ViT 1280 x 32), demo
    # vocabulary, random weights: 1.33 B LM parameters (the real model's 151k-token embedding aside)
    "2b": DemoSize(vocab=9000, hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960,
                   mrope_section=(16, 24, 24), vit_width=1280, vit_depth=32, vit_heads=16, vit_intermediate=3420),
}
PRESET_ARCHS = {"2b": ("qwen2_vl", "qwen2_5_vl"), "small-d128": ("qwen2_vl", "qwen2_5_vl")}  # presets only some families have


def demo_config(arch: str, size: DemoSize, ids: dict[str, int], vocab: int, size_name: str = "tiny"):
    """The transformers config object for `arch` at `size`, with the tokenizer's ids (the Qwen3
    family also takes its own shape of the preset `size_name`)."""
    text = dict(
        vocab_size=vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, max_position_embeddings=32768, max_window_layers=size.layers,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": list(size.mrope_section)},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    token_ids = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"],
                     bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                     pad_token_id=ids["<|endoftext|>"])
    if arch in QWEN3_ARCHS:
        return qwen3_config(arch, size, QWEN3_PRESETS[size_name], token_ids, text)
    if sum(size.mrope_section) != size.hidden // size.heads // 2:
        raise ValueError(f"mrope_section {size.mrope_section} must sum to head_dim // 2")
    common = dict(patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                  temporal_patch_size=TEMPORAL_PATCH_SIZE, in_channels=3)
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision = dict(depth=size.vit_depth, embed_dim=size.vit_width, hidden_size=size.hidden,
                      num_heads=size.vit_heads, mlp_ratio=4, hidden_act="quick_gelu", **common)
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **token_ids)
    from transformers import Qwen2_5_VLConfig

    # Full attention every 4th block (Qwen2.5-VL-7B: 7, 15, 23, 31), at least in the last one.
    full = sorted({i for i in range(size.vit_depth) if i % 4 == 3} | {size.vit_depth - 1})
    vision = dict(depth=size.vit_depth, hidden_size=size.vit_width, out_hidden_size=size.hidden,
                  intermediate_size=size.vit_intermediate, num_heads=size.vit_heads,
                  hidden_act="silu", window_size=112, fullatt_block_indexes=full,
                  tokens_per_second=2, **common)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **token_ids)


def _redraw_weights(model, seed: int) -> None:
    """Re-draw Linear/Conv weights with std 1.5/sqrt(fan_in), embeddings with std 1, biases 0;
    MoE experts (fused [experts, out, in] parameters) and routers ([experts, in]) alike."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
            fused = [p for n, p in sorted(module.named_parameters(recurse=False)) if p.ndim == 3 or
                     (type(module).__name__.endswith("TopKRouter") and n == "weight")]
            for p in fused:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[-1])))
            if isinstance(module, (nn.Linear, nn.Conv3d, nn.Conv2d)):
                fan_in = module.weight[0].numel()
                std = 1.5 / math.sqrt(fan_in)
            elif isinstance(module, nn.Embedding):
                std = 1.0
            else:
                continue
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def _preprocessor_config() -> dict:
    """preprocessor_config.json for `Qwen2VLImageProcessor` (as Qwen2-VL-7B-Instruct ships it)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3, "rescale_factor": 1 / 255,
        "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def _video_preprocessor_config() -> dict:
    """video_preprocessor_config.json for `Qwen2VLVideoProcessor`, with frame sampling on (as
    transformers recommends for new models; epdserve takes video only then) and a per-frame pixel
    budget of 4..256 tokens."""
    image = {k: v for k, v in _preprocessor_config().items() if k != "image_processor_type"}
    return dict(image, video_processor_type="Qwen2VLVideoProcessor", do_sample_frames=True, fps=2.0,
                min_frames=4, max_frames=768, size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 256},
                min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 256)


def build_demo_model(out_dir, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0) -> pathlib.Path:
    """Write a random-weight `arch` checkpoint of preset `size` into `out_dir`; return its path.

    The directory loads with `AutoModelForImageTextToText`, `AutoTokenizer` and
    `Qwen2VLImageProcessor` `.from_pretrained`. Existing files of the same names are replaced.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if arch not in PRESET_ARCHS.get(size, ARCHS):
        raise ValueError(f"size {size!r} is for {', '.join(PRESET_ARCHS[size])} only, got {arch!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from epdserve.model.demo_tokenizer import build_demo_tokenizer, special_token_ids

    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[size]

    tokenizer = build_demo_tokenizer(preset.vocab, seed=seed)
    ids = special_token_ids(tokenizer)
    config = demo_config(arch, preset, ids, vocab=len(tokenizer), size_name=size)

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _redraw_weights(model, seed)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    files = qwen3_preprocessor_files() if arch in QWEN3_ARCHS else {"preprocessor_config.json": _preprocessor_config()}
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        files["video_preprocessor_config.json"] = _video_preprocessor_config()
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `demo-model` subcommand on an argparse `subparsers` object."""
    parser = subparsers.add_parser(
        "demo-model",
        help="write a random-weight Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) checkpoint for demos and tests",
        description="Write a random-weight checkpoint directory laid out like a downloaded "
                    "Qwen2-VL-7B-Instruct (config, fp32 safetensors, offline tokenizer with chat "
                    "template, image-processor and video-processor configs). Nothing "
                    "is downloaded; the same seed gives identical files. tiny builds in seconds; small "
                    "has about 90M parameters (qwen3_vl 100M; qwen3_vl_moe 130M, 75M active per token); 2b "
                    "(qwen2_vl / qwen2_5_vl only) has Qwen2-VL-2B's shapes with the demo vocabulary and random "
                    "weights (1.33B LM parameters, 2.0B in all: 8 GB of fp32 files).",
    )
    parser.add_argument("out_dir", metavar="DIR", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen2_vl", help="model family (default: qwen2_vl)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="size preset (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for weights and tokenizer (default: 0)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Build the checkpoint described by parsed CLI `args`; print where and how big."""
    start = time.perf_counter()
    path = build_demo_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    print(f"wrote {args.arch} {args.size} demo model to {path} "
          f"({n / 1e6:.1f}M parameters, {time.perf_counter() - start:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: `python -m epdserve.model.demo DIR --arch ... --size ...`."""
    parser = argparse.ArgumentParser(prog="epdserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo-model", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
