"""Qwen3-VL / Qwen3-VL-MoE shapes of the demo checkpoints (epdserve.model.demo builds them).

Owns the Qwen3 family's preset adjustments (`QWEN3_PRESETS`), `qwen3_config` (the transformers
config: explicit `head_dim`, interleaved M-RoPE, DeepStack indexes in the vision tower, MoE
layers for `qwen3_vl_moe`) and the preprocessor files as the Hub ships them: a
`preprocessor_config.json` naming the *fast* image processor and a
`video_preprocessor_config.json` naming `Qwen3VLVideoProcessor` (both need torchvision, which
epdserve does without: the loader reads them with the PIL image processor).

The pixel bounds are smaller than the Hub's (65536..16777216 px) so tiny tests stay fast: a
merged token covers 32x32 px, images get 1..1280 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

QWEN3_ARCHS = ("qwen3_vl", "qwen3_vl_moe")
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 32 * 32, 32 * 32 * 1280


@dataclass(frozen=True)
class Qwen3Shape:
    """What a Qwen3 demo adds to or changes in the shared `DemoSize` preset of the same name."""

    layers: int
    head_dim: int
    mrope_section: tuple[int, int, int]  # interleaved: T gets the rest, H/W every third frequency
    vit_depth: int
    deepstack: tuple[int, ...]  # vision blocks whose merged outputs go to LM layers 0, 1, ...
    pos_embeddings: int  # a square number: the learned position grid
    experts: int  # MoE only
    experts_per_tok: int
    moe_intermediate: int


QWEN3_PRESETS = {
    "tiny": Qwen3Shape(layers=3, head_dim=16, mrope_section=(4, 2, 2), vit_depth=3, deepstack=(0, 1),
                       pos_embeddings=256, experts=8, experts_per_tok=2, moe_intermediate=32),
    "small": Qwen3Shape(layers=8, head_dim=64, mrope_section=(12, 10, 10), vit_depth=8, deepstack=(1, 3, 5),
                        pos_embeddings=2304, experts=16, experts_per_tok=4, moe_intermediate=384),
}


def qwen3_config(arch: str, size, shape: Qwen3Shape, token_ids: dict, text: dict):
    """The transformers config of `arch` from the shared preset `size`, its `shape` and the common
    `text` / `token_ids` dicts that demo.demo_config builds for every family."""
    if sum(shape.mrope_section) != shape.head_dim // 2:
        raise ValueError(f"mrope_section {shape.mrope_section} must sum to head_dim // 2")
    text = dict(text, num_hidden_layers=shape.layers, head_dim=shape.head_dim, max_window_layers=shape.layers)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000000.0,
                               "mrope_section": list(shape.mrope_section), "mrope_interleaved": True}
    vision = dict(depth=shape.vit_depth, hidden_size=size.vit_width, out_hidden_size=size.hidden,
                  intermediate_size=size.vit_intermediate, num_heads=size.vit_heads,
                  hidden_act="gelu_pytorch_tanh", num_position_embeddings=shape.pos_embeddings,
                  deepstack_visual_indexes=list(shape.deepstack), patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, in_channels=3)
    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **token_ids)
    from transformers import Qwen3VLMoeConfig

    text.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_tok,
                moe_intermediate_size=shape.moe_intermediate, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **token_ids)


def qwen3_preprocessor_files() -> dict[str, dict]:
    """File name → JSON content of the image and video preprocessor configs, as the Hub ships them."""
    common = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3, "rescale_factor": 1 / 255,
        "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "processor_class": "Qwen3VLProcessor",
    }
    image = dict(common, image_processor_type="Qwen2VLImageProcessorFast",
                 size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    video = dict(common, video_processor_type="Qwen3VLVideoProcessor", fps=2, min_frames=4, max_frames=768,
                 do_sample_frames=True, size={"shortest_edge": 4096, "longest_edge": 25165824})
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}
