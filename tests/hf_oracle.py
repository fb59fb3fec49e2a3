"""Transformers' own answer to a prompt with images, the oracle exactness tests compare with.

`hf_processor` is the family's processor class (`Qwen2VLProcessor` / `Qwen2_5_VLProcessor` /
`Qwen3VLProcessor`: tokenization and placeholder expansion) over the checkpoint's tokenizer and its
image processor in the PIL backend (the slow one: resize, rescale, normalize, patchify).
`AutoProcessor` itself cannot be used without torchvision (it also loads the video processor), so
the class is built with no video processor (`_images_only`). `HFOracle.generate` runs it and greedy
`generate` of `AutoModelForImageTextToText`; nothing on this side comes from epdserve's
preprocessing (`epdserve.model.processor`), its reference (`epdserve.model.reference`) or its engine.
Image bytes are decoded with PIL, as a client of transformers would.
"""
from __future__ import annotations

import io

import torch
from PIL import Image

FAMILY_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor"}


def _images_only(cls):
    """`cls` without a video processor: ProcessorMixin checks each part's class against the auto
    mappings, and the video mapping is unavailable without torchvision."""
    class ImagesOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = cls.__name__
    return ImagesOnly


def hf_processor(model_dir):
    """The family's processor over the checkpoint's tokenizer and PIL (slow) image processor."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    cls = getattr(transformers, FAMILY_PROCESSORS[AutoConfig.from_pretrained(model_dir).model_type])
    return _images_only(cls)(image_processor=AutoImageProcessor.from_pretrained(model_dir, backend="pil"),
                             tokenizer=AutoTokenizer.from_pretrained(model_dir), video_processor=None)


class HFOracle:
    """Greedy `generate` of transformers on what its own processor makes of (prompt, images)."""

    def __init__(self, model_dir):
        from transformers import AutoModelForImageTextToText

        self.processor = hf_processor(model_dir)
        self.tokenizer = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    def inputs(self, prompt: str, images=()):
        pil = [Image.open(io.BytesIO(im)).convert("RGB") if isinstance(im, (bytes, bytearray)) else im for im in images]
        return self.processor(text=[prompt], images=pil or None, return_tensors="pt")

    @torch.inference_mode()
    def generate(self, prompt: str, images=(), max_tokens: int = 16, ignore_eos: bool = False) -> list[int]:
        """Output token ids (an EOS that ends the output included). ignore_eos: vLLM's, EOS no stop."""
        inputs = self.inputs(prompt, images)
        kw = {"eos_token_id": None} if ignore_eos else {}
        out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=self.tokenizer.pad_token_id or 0, **kw)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    @torch.inference_mode()
    def generate_with_margins(self, prompt: str, images=(), max_tokens: int = 16) -> tuple[list[int], list[float]]:
        """Greedy output ids (EOS no stop) and, per output position, the gap between its top two
        logits (raw, fp32): where a sum computed in another order may flip the choice."""
        inputs = self.inputs(prompt, images)
        out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=self.tokenizer.pad_token_id or 0, output_logits=True,
                                  return_dict_in_generate=True)
        margins = [float(d[0] - d[1]) for d in (step[0].float().topk(2).values for step in out.logits)]
        return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), margins

    def chat_prompt(self, messages: list[dict]) -> str:
        """The checkpoint's chat template (chat_template.jinja, read by its tokenizer) over `messages`
        (image parts by placeholder), as text."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


NEAR_TIE = 1e-4  # top-2 logits this close: a reduction in another order may pick the other one


def assert_same_greedy(got: list[int], want: list[int], margins: list[float], what: str = "",
                       near_tie: float = NEAR_TIE) -> None:
    """`got` equals transformers' greedy `want` token for token, except after a position where
    transformers' own top two logits were within `near_tie` (then the outputs may part there): such a
    position is printed with its margin, never hidden; a mismatch anywhere else fails."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert margins[i] < near_tie, (f"{what}: token {i} is {g}, transformers' {w} (top-2 margin "
                                           f"{margins[i]:.3g}, not a near tie); got {got}, want {want}")
            print(f"{what}: parted from transformers at a near tie, token {i} (margin {margins[i]:.3g})")
            return
    assert len(got) == len(want), f"{what}: {len(got)} tokens, transformers gave {len(want)}"
