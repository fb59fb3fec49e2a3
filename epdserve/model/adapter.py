"""VLM adapter: splits a HF Qwen-VL model into a vision encoder and a language model.

The engine sees only this interface: `encode_images` (pixels → one embedding per image),
`embed_tokens`, `rope_index` (M-RoPE positions + delta per request, no module state),
`layers` / `rotary` / `norm` / `lm_head` for its own layer loop. Qwen3-VL's deepstack features
would travel as extra tensors in each image's feature list (`features[1:]`); the Qwen2 family
has none.
"""
from __future__ import annotations

import torch


class VLMAdapter:
    def __init__(self, hf_model: torch.nn.Module):
        self.hf = hf_model
        self.base = hf_model.model  # *Model: .visual, .language_model
        self.config = hf_model.config
        tc = self.config.text_config
        self.text_config = tc
        self.image_token_id = self.config.image_token_id
        self.video_token_id = getattr(self.config, "video_token_id", None)
        self.vision_start_token_id = self.config.vision_start_token_id
        self.vision_end_token_id = getattr(self.config, "vision_end_token_id", None)
        self.merge_size = self.config.vision_config.spatial_merge_size
        self.num_layers = tc.num_hidden_layers
        self.num_heads = tc.num_attention_heads
        self.num_kv_heads = tc.num_key_value_heads
        self.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        self.hidden_size = tc.hidden_size
        self.max_position_embeddings = tc.max_position_embeddings
        lm = self.base.language_model
        self.layers = lm.layers
        self.rotary = lm.rotary_emb
        self.norm = lm.norm
        self.embed = lm.embed_tokens
        self.lm_head = hf_model.lm_head

    @property
    def vision_tower(self) -> torch.nn.Module:
        return self.base.visual

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def tokens_per_image(self, grid_thw) -> int:
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // (self.merge_size**2)

    @torch.inference_mode()
    def encode_images(self, pixel_values: list[torch.Tensor], grid_thw: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Run the vision tower on a batch of images; one feature list per image ([embeds])."""
        pv = torch.cat(pixel_values).to(self.device)
        grid = torch.stack([g.reshape(3) for g in grid_thw]).to(self.device)
        out = self.base.get_image_features(pv, grid)
        return [[f] for f in out.pooler_output]

    @torch.inference_mode()
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids.to(self.device))

    @torch.inference_mode()
    def rope_index(self, input_ids: list[int], grid_thw: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, S] of a prompt and its delta (text position of token i = i + delta)."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        if not grid_thw:
            return torch.arange(len(input_ids)).expand(3, -1).clone(), 0
        mm_types = (ids == self.image_token_id).int()
        grid = torch.stack([g.reshape(3) for g in grid_thw])
        pos, delta = self.base.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
        return pos[:, 0].clone(), int(delta.reshape(-1)[0])
