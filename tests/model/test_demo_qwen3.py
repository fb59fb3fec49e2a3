"""Qwen3-VL / Qwen3-VL-MoE demo checkpoints: Hub layout, offline loading without torchvision, shapes."""
import json

import pytest
import torch

from epdserve.model.demo import PRESETS, build_demo_model, demo_config
from epdserve.model.demo_images import procedural_image
from epdserve.model.demo_tokenizer import build_demo_tokenizer, special_token_ids
from epdserve.model.loader import load_checkpoint


@pytest.fixture(params=["qwen3_vl", "qwen3_vl_moe"])
def qwen3_dir(request):
    return request.getfixturevalue(f"{request.param}_tiny")


def test_hub_layout_names_the_torchvision_processors(qwen3_dir):
    image = json.loads((qwen3_dir / "preprocessor_config.json").read_text())
    video = json.loads((qwen3_dir / "video_preprocessor_config.json").read_text())
    assert image["image_processor_type"] == "Qwen2VLImageProcessorFast" and image["patch_size"] == 16
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
    cfg = json.loads((qwen3_dir / "config.json").read_text())
    assert cfg["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    assert cfg["vision_config"]["deepstack_visual_indexes"] == [0, 1]


def test_loads_offline_with_the_pil_image_processor(qwen3_dir):
    ckpt = load_checkpoint(qwen3_dir)
    assert type(ckpt.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    out = ckpt.image_processor(images=[procedural_image(56, 84, seed=0)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 6, 4]]  # 16-px patches of the 64x96 resize
    assert tuple(out["pixel_values"].shape) == (24, 3 * 2 * 16 * 16)
    feats = ckpt.model.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
    assert len(feats.deepstack_features) == 2 and feats.pooler_output[0].shape == (6, 64)


def test_moe_layers_and_redrawn_experts(qwen3_vl_moe_tiny):
    ckpt = load_checkpoint(qwen3_vl_moe_tiny)
    layers = ckpt.model.model.language_model.layers
    assert all(type(layer.mlp).__name__ == "Qwen3VLMoeTextSparseMoeBlock" for layer in layers)
    experts, router = layers[0].mlp.experts, layers[0].mlp.gate
    # std 1.5/sqrt(fan_in), not the default 0.02: routing and outputs depend on the input
    assert experts.gate_up_proj.std() > 0.1 and router.weight.std() > 0.1


def test_same_seed_same_files(tmp_path, qwen3_vl_moe_tiny):
    again = build_demo_model(tmp_path / "again", arch="qwen3_vl_moe", size="tiny", seed=0)
    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        assert (again / name).read_bytes() == (qwen3_vl_moe_tiny / name).read_bytes(), name


def test_small_presets():
    tok = build_demo_tokenizer(PRESETS["small"].vocab, seed=0)
    from transformers import AutoModelForImageTextToText

    sizes = {}
    for arch in ("qwen3_vl", "qwen3_vl_moe"):
        cfg = demo_config(arch, PRESETS["small"], special_token_ids(tok), vocab=len(tok), size_name="small")
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(cfg)
        sizes[arch] = sum(p.numel() for p in model.parameters())
    assert 90e6 < sizes["qwen3_vl"] < 110e6
    assert 120e6 < sizes["qwen3_vl_moe"] < 145e6


def test_cli_accepts_qwen3(tmp_path, capsys):
    from epdserve.model.demo import main

    assert main([str(tmp_path / "m"), "--arch", "qwen3_vl", "--size", "tiny"]) == 0
    assert "qwen3_vl tiny" in capsys.readouterr().out
    assert (tmp_path / "m" / "video_preprocessor_config.json").is_file()
