"""The lean language-model forward the engine runs (transformers stays the loader, the vision
tower and the reference):

- weights.py   LeanLayerWeights: one decoder layer's weights, QKV and gate-up fused, read from the
               transformers modules by their checkpoint names
- rotary.py    RotaryTable: M-RoPE cos/sin of every position, gathered per token once a step
- forward.py   LeanLM: the layer loop over packed tokens (LayerOps between the matmuls, paged
               attention, KV-connector hooks, DeepStack), no host decision per layer
"""
