"""`ExpertShard`: a Qwen3-VL-MoE sparse layer's router and one rank's share of its experts
(expert parallelism over the tensor-parallel group, issue 47 item 3).

Every rank holds the router (`mlp.gate`) whole and routes every token alike (its input is the
same on every rank: the residual stream after an all-reduce); rank r of tp holds experts
[r·E/tp, (r+1)·E/tp) only and adds the weighted outputs of those it holds; the all-reduce after
the MLP (engine/lm/forward.py `reduce`) sums the ranks' parts, so each token gets all of its
top-k experts. At tp = 1 one rank holds every expert.

The arithmetic is transformers' own (`Qwen3VLMoeTextTopKRouter` and `Qwen3VLMoeTextExperts` in
transformers 5.24's modeling_qwen3_vl_moe.py): softmax in fp32, top-k, the top-k weights
renormalised and cast back, per expert `linear(x, gate_up[e])` split in gate and up halves,
`silu(gate) * up`, `linear(·, down[e])`, scaled by the token's weight and `index_add_`-ed in
ascending expert order — so at tp = 1 the sum is transformers' sum, bit for bit; above 1 only
the order in which the ranks' parts are summed differs.

The experts are held by the method the dense linears run (`--quantization`; engine/lm/
expert_linears.py): one projection per local expert for gate_up and one for down, each applied in
that same order (or, for a checkpoint whose experts are quantized already, those projections as
read: `ExpertShard.of_projections`). Quantized, they compute with their dequantized weights (up to the kernel's
rounding); the router stays in the model dtype, never quantized.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.engine.lm.expert_linears import expert_linears


class ExpertShard:
    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, first: int, top_k: int,
                 method: str = "dense", platform: str = "cpu"):
        """`router` [E, hidden]; `gate_up` [E_local, 2 I, hidden] and `down` [E_local, hidden, I]:
        experts first .. first + E_local - 1 of E, held by `method` on `platform` (engine/lm/linear.py
        `linear_class`)."""
        self.router, self.method = router, method
        self.gate_up = expert_linears(gate_up, method, "gate_up_proj (hidden_size)", platform)
        self.down = expert_linears(down, method, "down_proj (moe_intermediate_size)", platform)
        self.first, self.top_k = first, top_k
        self.num_local = len(self.gate_up)

    @classmethod
    def of_projections(cls, router: torch.Tensor, gate_up: list, down: list, first: int, top_k: int,
                       method: str) -> ExpertShard:
        """The shard of experts built already (a checkpoint's own quantized experts, engine/lm/
        per_expert.py): `gate_up[i]` and `down[i]` expert first + i's projections, held by `method`."""
        self = cls.__new__(cls)
        self.router, self.method = router, method
        self.gate_up, self.down = list(gate_up), list(down)
        self.first, self.top_k = first, top_k
        self.num_local = len(self.gate_up)
        return self

    def parameters(self) -> list[torch.Tensor]:
        return [self.router] + [t for lin in self.gate_up + self.down for t in lin.tensors()]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] → this rank's part of the layer's output, same shape."""
        x = hidden.reshape(-1, hidden.shape[-1])
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        local = experts - self.first
        for e in torch.unique(local[(local >= 0) & (local < self.num_local)]).tolist():  # ascending
            pos, token = torch.where((local == e).T)  # transformers' order: by top-k slot, then token
            gate, up = self.gate_up[e](x[token]).chunk(2, dim=-1)
            h = self.down[e](F.silu(gate) * up) * weights[token, pos, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out.reshape(hidden.shape)
