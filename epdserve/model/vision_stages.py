"""`VisionRun`: one vision-tower forward over a batch of media, run a few blocks at a time.

The engine's step-time budget (engine/step_budget.py) lets an encode take only the blocks that
fit beside the step's decodes, so the tower's forward is split at its block loop: `VisionRun`
does the prologue at construction (patch embedding, position embeddings, attention segments),
`run(n)` the next `n` blocks, carrying the hidden state between calls, and `finish()` the
epilogue (merger), returning what `VLMAdapter.encode_images` returns for the same batch.

It calls the tower's own submodules and the helpers of its own modeling module, in the order
its `forward` does, so the features are the same tensors bit for bit (tests/model/
test_vision_stages.py). The forwards it follows (transformers 5.x): Qwen2-VL
`Qwen2VisionTransformerPretrainedModel.forward`; Qwen2.5-VL
`Qwen2_5_VisionTransformerPretrainedModel.forward` (window attention: windowed blocks but the
`fullatt_block_indexes`, input permuted by `get_vision_window_index`, merger output un-permuted);
Qwen3-VL and Qwen3-VL-MoE `Qwen3VL(Moe)VisionModel.forward` (interpolated position embedding,
DeepStack features taken after the blocks in `deepstack_visual_indexes`). `sliceable(model_type)`
says which; any other tower runs whole through `encode_images`.
"""
from __future__ import annotations

import sys

import torch

_FAMILIES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2_5", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3"}


def sliceable(model_type: str) -> bool:
    return model_type in _FAMILIES


class VisionRun:
    def __init__(self, adapter, pixel_values: list[torch.Tensor], grid_thw: list[torch.Tensor]):
        self.family = _FAMILIES[adapter.config.model_type]
        self.tower = tower = adapter.vision_tower
        self.num_deepstack = adapter.num_deepstack
        self._helpers = sys.modules[type(tower).__module__]
        with torch.inference_mode():
            pv = torch.cat(pixel_values).to(adapter.device).type(tower.dtype)  # as get_image_features
            self.grid = torch.stack([g.reshape(3) for g in grid_thw]).to(adapter.device)
            self.num_patches = int(pv.shape[0])
            getattr(self, f"_prologue_{self.family}")(pv)
        self.num_blocks = len(tower.blocks)
        self.blocks_done = 0
        self.deepstack: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return self.blocks_done >= self.num_blocks

    @torch.inference_mode()
    def run(self, n: int) -> int:
        """Run up to `n` more blocks (at least one, if any are left); returns how many ran."""
        n = max(1, min(n, self.num_blocks - self.blocks_done))
        if self.done:
            return 0
        t = self.tower
        for i in range(self.blocks_done, self.blocks_done + n):
            cu, mx = self._segments(i)
            self.hidden = t.blocks[i](self.hidden, cu_seqlens=cu, max_seqlen=mx, position_embeddings=self.pos)
            if self.family == "qwen3" and i in t.deepstack_visual_indexes:
                merger = t.deepstack_merger_list[t.deepstack_visual_indexes.index(i)]
                self.deepstack.append(merger(self.hidden))
        self.blocks_done += n
        return n

    @torch.inference_mode()
    def finish(self) -> list[list[torch.Tensor]]:
        """The remaining blocks, then the merger: one feature list per media item (the merged
        embedding, then its DeepStack features), as `VLMAdapter.encode_images`."""
        while not self.done:
            self.run(self.num_blocks)
        merged = self.tower.merger(self.hidden)
        if self.family == "qwen2_5":
            merged = merged[torch.argsort(self.window_index), :]
        sizes = (self.grid.prod(-1) // self.tower.spatial_merge_size ** 2).tolist()
        per_item = torch.split(merged, sizes)
        deep = [torch.split(f, sizes) for f in self.deepstack]
        self.hidden = self.pos = None  # the carried state goes with the run
        return [[f, *(layer[i] for layer in deep)] for i, f in enumerate(per_item)]

    # ---------------------------------------------------------------- per family
    def _segments(self, i: int):
        if self.family == "qwen2_5" and i not in self.tower.fullatt_block_indexes:
            return self.cu_window, self.max_window
        return self.cu_seqlens, self.max_seqlen

    def _common(self, pv: torch.Tensor) -> None:
        h, t = self._helpers, self.tower
        self.position_ids = h.get_vision_position_ids(self.grid, t.spatial_merge_size, kwargs={})
        self.cu_seqlens, self.max_seqlen = h.get_vision_attention_seqlens(self.grid, t.config, kwargs={})

    def _prologue_qwen2(self, pv: torch.Tensor) -> None:
        self._common(pv)
        self.hidden = self.tower.patch_embed(pv)
        self.pos = self.tower.rotary_pos_emb(self.hidden, self.position_ids)

    def _prologue_qwen2_5(self, pv: torch.Tensor) -> None:
        h, t = self._helpers, self.tower
        self._common(pv)
        self.window_index, self.cu_window = h.get_vision_window_index(
            self.grid, spatial_merge_size=t.spatial_merge_size, window_size=t.window_size,
            patch_size=t.patch_size, kwargs={})
        self.max_window = h.get_max_seqlen(self.cu_window, t.config, kwargs={}, kwarg_name="max_window_seqlen")
        hidden = t.patch_embed(pv)
        seq_len = hidden.size(0)
        self.hidden = t.permute_input_for_window_attn(hidden, self.window_index, seq_len=seq_len)
        pos = t.rotary_pos_emb(self.hidden, self.position_ids)
        self.pos = tuple(t.permute_input_for_window_attn(f, self.window_index, seq_len=seq_len) for f in pos)

    def _prologue_qwen3(self, pv: torch.Tensor) -> None:
        h, t = self._helpers, self.tower
        idx, weights = h.get_vision_interpolation_indices_and_weights(
            self.grid, num_grid_per_side=t.num_grid_per_side, mode=t.interpolation_mode,
            align_corners=t.interpolation_align_corners, spatial_merge_size=t.config.spatial_merge_size, kwargs={})
        self._common(pv)
        hidden = t.patch_embed(pv)
        pos_embeds = (t.pos_embed(idx) * weights[:, :, None]).sum(1)
        hidden = hidden + pos_embeds.to(hidden.dtype)
        self.pos = t.rotary_pos_emb(hidden, self.position_ids)
        self.hidden = hidden.reshape(hidden.size(0), -1)
