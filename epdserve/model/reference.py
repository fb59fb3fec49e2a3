"""The correctness oracle: transformers' own `generate` on exactly the inputs epdserve builds.

`ReferenceGenerator` loads the checkpoint with stock transformers (sdpa attention, its own
cache) and runs greedy `generate` one request at a time on the expanded token ids, pixels,
grids and `mm_token_type_ids`. Tests and benchmarks compare every mode's greedy output to it.
"""
from __future__ import annotations

import torch

from epdserve.model.processor import MultimodalProcessor


class ReferenceGenerator:
    def __init__(self, model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """The checkpoint on `device` (inputs follow it there) in `dtype` (fp32: the exactness oracle)."""
        from epdserve.model.loader import load_checkpoint

        ckpt = load_checkpoint(model_dir, device, dtype)
        self.model = ckpt.model
        self.tokenizer = ckpt.tokenizer
        cfg = ckpt.model.config
        self.image_token_id = cfg.image_token_id
        self.processor = MultimodalProcessor(
            ckpt.tokenizer, ckpt.image_processor, cfg.image_token_id, cfg.vision_config.spatial_merge_size, 1 << 30
        )

    @torch.inference_mode()
    def generate(self, prompt, images=None, max_tokens: int = 16, ignore_eos: bool = True,
                 logits_processor=None) -> list[int]:
        """Greedy output token ids (EOS included when it ends the output, as epdserve reports it);
        `logits_processor`: transformers' LogitsProcessor list (a structured output's grammar)."""
        p = self.processor.process(prompt, images)
        device = self.model.device
        ids = torch.tensor([p.token_ids], device=device)
        kw = {}
        if p.media:
            kw = dict(
                pixel_values=torch.cat([m.pixel_values for m in p.media]).to(device, self.model.dtype),
                image_grid_thw=torch.stack([m.grid_thw for m in p.media]).to(device),
                mm_token_type_ids=(ids == self.image_token_id).int(),
            )
        if ignore_eos:  # vLLM's ignore_eos: EOS is no stop, but may still be generated (min_new_tokens would mask it)
            kw.update(eos_token_id=None, pad_token_id=self.tokenizer.pad_token_id or 0)
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
            logits_processor=logits_processor, **kw
        )
        return out[0, ids.shape[1] :].tolist()
