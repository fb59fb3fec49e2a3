"""Tests for epdserve.model.demo / demo_tokenizer / demo_images: tiny checkpoints load and behave."""
import json

import pytest
import torch

from epdserve.model.demo import build_demo_model
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.demo_tokenizer import SPECIAL_TOKENS


def _load(path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessor.from_pretrained(path)


def _generate(model, tokenizer, processor, text, image):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels = processor(images=[image], return_tensors="pt")
    n_tokens = int(pixels["image_grid_thw"].prod()) // 4
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
    inputs = tokenizer(prompt, return_tensors="pt")
    mm = (inputs["input_ids"] == model.config.image_token_id).long()
    with torch.no_grad():
        out = model.generate(**inputs, **pixels, mm_token_type_ids=mm, do_sample=False, max_new_tokens=8)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_files_and_ids(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "preprocessor_config.json"} <= names
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg["text_config"]["vocab_size"] == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for special in SPECIAL_TOKENS:
        assert len(tok(special)["input_ids"]) == 1


def test_chat_template(qwen2_vl_tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_vl_tiny)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "What is this?"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain.startswith("<|im_start|>system\n") and plain.endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_outputs_depend_on_image_and_prompt(tiny_model_dir):
    model, tok, proc = _load(tiny_model_dir)
    img_a, img_b = procedural_image(112, 84, seed=1), procedural_image(112, 84, seed=2)
    base = _generate(model, tok, proc, "What is in this image?", img_a)
    assert len(base) == 8
    assert _generate(model, tok, proc, "What is in this image?", img_b) != base
    assert _generate(model, tok, proc, "Describe the colors.", img_a) != base


def test_image_processor_token_counts(qwen2_vl_tiny):
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor.from_pretrained(qwen2_vl_tiny)
    out = proc(images=[procedural_image(448, 448, seed=0)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 32, 32]]
    assert tuple(out["pixel_values"].shape) == (1024, 3 * 2 * 14 * 14)
    small = proc(images=[procedural_image(56, 56, seed=0)], return_tensors="pt")
    assert small["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_same_seed_same_files(tmp_path, qwen2_5_vl_tiny):
    again = build_demo_model(tmp_path / "again", arch="qwen2_5_vl", size="tiny", seed=0)
    other = build_demo_model(tmp_path / "other", arch="qwen2_5_vl", size="tiny", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (qwen2_5_vl_tiny / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_demo_model(tmp_path, arch="llava")
    with pytest.raises(ValueError, match="size"):
        build_demo_model(tmp_path, size="huge")
    with pytest.raises(ValueError, match="seed"):
        build_demo_model(tmp_path, seed=-1)


def test_procedural_images():
    a, b = procedural_image(64, 48, seed=3), procedural_image(64, 48, seed=3)
    assert a.size == (64, 48) and a.mode == "RGB"
    assert a.tobytes() == b.tobytes()
    assert procedural_image(64, 48, seed=4).tobytes() != a.tobytes()
    data = jpeg_bytes(a)
    assert data[:2] == b"\xff\xd8"
    with pytest.raises(ValueError):
        procedural_image(0, 10)


def test_small_preset_is_about_90m():
    from transformers import AutoModelForImageTextToText

    from epdserve.model.demo import PRESETS, demo_config
    from epdserve.model.demo_tokenizer import build_demo_tokenizer, special_token_ids

    tok = build_demo_tokenizer(PRESETS["small"].vocab, seed=0)
    for arch in ("qwen2_vl", "qwen2_5_vl"):
        cfg = demo_config(arch, PRESETS["small"], special_token_ids(tok), vocab=len(tok))
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(cfg)
        n = sum(p.numel() for p in model.parameters())
        assert 80e6 < n < 100e6, (arch, n)


def test_cli(tmp_path, capsys):
    import argparse

    from epdserve.model.demo import add_parser, main

    assert main([str(tmp_path / "m"), "--arch", "qwen2_vl", "--size", "tiny", "--seed", "3"]) == 0
    assert "parameters" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").is_file()
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo-model", "x", "--arch", "qwen2_5_vl"])
    assert args.func is not None and args.size == "tiny" and args.seed == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["demo-model", "x", "--size", "huge"])


def test_2b_preset_has_qwen2_vl_2b_shapes_and_refuses_qwen3():
    """Qwen2-VL-2B's LM and ViT shapes with the demo vocabulary (the device check's decode timings)."""
    from transformers import AutoModelForImageTextToText

    from epdserve.model.demo import PRESETS, build_demo_model, demo_config
    from epdserve.model.demo_tokenizer import build_demo_tokenizer, special_token_ids

    tok = build_demo_tokenizer(PRESETS["2b"].vocab, seed=0)
    cfg = demo_config("qwen2_vl", PRESETS["2b"], special_token_ids(tok), vocab=len(tok), size_name="2b")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    lm = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    assert 1.30e9 < lm < 1.36e9
    assert (cfg.text_config.hidden_size, cfg.text_config.num_hidden_layers, cfg.vision_config.embed_dim) == (1536, 28, 1280)
    with pytest.raises(ValueError, match="2b"):
        build_demo_model("/nonexistent-never-written", arch="qwen3_vl", size="2b")
