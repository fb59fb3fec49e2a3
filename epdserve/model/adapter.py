"""VLM adapter: splits a HF Qwen-VL model into a vision encoder and a language model.

The engine sees only this interface: `encode_images` (pixels → one embedding per image),
`embed_tokens`, `rope_index` (M-RoPE positions + delta per request, no module state),
`layers` / `rotary` / `norm` / `lm_head` for its own layer loop.

An image's features are one list of tensors, stored and moved E→P as one value: `features[0]`
is the merged embedding that replaces its pad tokens; for Qwen3-VL, `features[1 + i]` is its
DeepStack feature for LM layer i (added to the image tokens' hidden states after that layer,
`num_deepstack` of them); the Qwen2 family has none. Qwen3-VL's rotary embedding interleaves
the M-RoPE sections itself (`rotary`); its positions come from the model's `get_rope_index`.
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
        self.num_deepstack = len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or ())
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
        """Run the vision tower on a batch of images; one feature list per image
        ([embeds, deepstack for LM layer 0, 1, ...])."""
        pv = torch.cat(pixel_values).to(self.device)
        grid = torch.stack([g.reshape(3) for g in grid_thw]).to(self.device)
        out = self.base.get_image_features(pv, grid)
        deepstack = getattr(out, "deepstack_features", None) or []
        if len(deepstack) != self.num_deepstack:
            raise RuntimeError(f"vision tower gave {len(deepstack)} deepstack features, config says {self.num_deepstack}")
        return [[f, *(layer[i] for layer in deepstack)] for i, f in enumerate(out.pooler_output)]

    @torch.inference_mode()
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids.to(self.device))

    @torch.inference_mode()
    def rope_index(self, input_ids: list[int], grid_thw: list[torch.Tensor],
                   seconds_per_grid: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, S] of a prompt and its delta (text position of token i = i + delta).

        `grid_thw` lists the media in prompt order; which are videos the prompt says: a run of
        video tokens starts a video (Qwen3-VL: one run per temporal patch, text between them).
        `seconds_per_grid`, per media item, is a video's seconds per temporal patch (Qwen2.5-VL
        spaces its temporal positions by it)."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        if not grid_thw:
            return torch.arange(len(input_ids)).expand(3, -1).clone(), 0
        mm_types = (ids == self.image_token_id).int()
        if self.video_token_id is not None:
            mm_types[ids == self.video_token_id] = 2
        images, videos, video_idx = self._split_grids(mm_types[0].tolist(), grid_thw)
        kw = {}
        if images:
            kw["image_grid_thw"] = torch.stack(images)
        if videos:
            kw["video_grid_thw"] = torch.stack(videos)
            if self.config.model_type == "qwen2_5_vl":
                secs = [(seconds_per_grid or [None] * len(grid_thw))[i] for i in video_idx]
                if any(s is None for s in secs):
                    raise ValueError("Qwen2.5-VL video positions need each video's seconds per temporal patch")
                kw["second_per_grid_ts"] = torch.tensor(secs)  # float32, as the processor's BatchFeature
        pos, delta = self.base.get_rope_index(ids, mm_token_type_ids=mm_types, **kw)
        return pos[:, 0].clone(), int(delta.reshape(-1)[0])

    def _split_grids(self, types: list[int], grid_thw: list[torch.Tensor]):
        images, videos, video_idx, grids = [], [], [], iter(enumerate(g.reshape(3) for g in grid_thw))
        runs_left, prev = 0, 0  # runs of tokens the current video still has
        per_patch_runs = self.config.model_type in ("qwen3_vl", "qwen3_vl_moe")  # a run per temporal patch
        for t in types:
            if t != prev and t == 1:
                images.append(next(grids)[1])
            elif t != prev and t == 2:
                if runs_left == 0:
                    i, g = next(grids)
                    videos.append(g)
                    video_idx.append(i)
                    runs_left = int(g[0]) if per_patch_runs else 1
                runs_left -= 1
            prev = t
        return images, videos, video_idx
