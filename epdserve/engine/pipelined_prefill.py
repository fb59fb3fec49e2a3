"""Per-item E→P pipelining: how far a prompt may be prefilled while some of its media still encode.

A prompt's KV is computed in order, so the tokens ahead of the first media item whose features
have not arrived need nothing more: they may be prefilled now. `PipelineState` (engine/request_parts.py; one per
request on a prefilling engine, `Sequence.pipeline`) holds the prompt embeddings with each arrived item's
features written at its placeholder rows, and `Sequence.prefill_limit`: the index of the first
placeholder token of the first item still missing (the prompt's length once every item is
there). The scheduler prefills chunks up to that limit only (engine/scheduler.py); each engine
step, as items land — from E through the MM Store's prefetch, or recomputed here after the
bounded wait, per item — `advance` writes their rows and raises the limit. The chunk boundaries
this adds are ordinary chunked-prefill boundaries: the output is the same token for token (the
KV of a token depends only on the tokens before it).

An item's placeholder tokens are the prompt's visual tokens of its rank range (items in prompt
order, each `num_tokens` of them; a video's are not contiguous: timestamps sit between its
temporal patches), so rows are found by rank, as DeepStack's (model/deepstack.py) are.
"""
from __future__ import annotations

import torch

from epdserve.engine.request_parts import PipelineState
from epdserve.engine.sequence import Sequence


@torch.inference_mode()  # the embeddings are inference tensors (ModelRunner.build_prompt_embeds)
def advance(seq: Sequence) -> bool:
    """Write the rows of the items whose features arrived since the last call into
    `seq.prompt_embeds` and raise `seq.prefill_limit`; True when it rose. Raises ValueError for
    features that do not fit their item."""
    st: PipelineState = seq.pipeline
    emb = seq.prompt_embeds
    for j, m in enumerate(seq.media):
        if j in st.filled or m.features is None:
            continue
        feats = m.features[0]
        rows = st.rows(j)
        if feats.shape[0] != len(rows):
            raise ValueError(f"media {m.key}: {feats.shape[0]} feature rows for {len(rows)} placeholder tokens")
        emb[torch.tensor(rows, dtype=torch.long, device=emb.device)] = feats.to(emb.device, emb.dtype)
        st.filled.add(j)
    missing = next((j for j in range(len(seq.media)) if j not in st.filled), None)
    limit = seq.prompt_len if missing is None else st.visual[st.offsets[missing]]
    rose = seq.prefill_limit is None or limit > seq.prefill_limit
    seq.prefill_limit = limit
    return rose
