"""The lean language-model forward the engine runs (transformers stays the vision tower and the
reference; engine/lm/shard_loader.py reads the decoder layers from the checkpoint's files):

- weights.py   LeanLayerWeights: one decoder layer's weights, QKV and gate-up fused (from the
               transformers modules by their checkpoint names, or as engine/lm/shard_loader.py reads them)
- linear.py    the linear-layer contract: a projection's weights held and applied by its method
               (dense, or quantized: `--quantization`), the rank's slice under tensor parallelism
- prepacked_linear.py  PrepackedLinear: the CPU's dense projection with its weight reordered once for oneDNN
- quant_linear.py  Int8Linear (W8A16) and Int8DynamicLinear (W8A8): int8 weights quantized at load
- int4_linear.py   Int4Linear (W4A16): 4-bit weights in groups of 128, quantized at load
- prequantized.py  checkpoints quantized already (msModelSlim W8A8_DYNAMIC, W8A8, W8A16): what their description says
- static_w8a8.py   StaticW8A8Linear: msModelSlim's static W8A8 (per-tensor input scale and offset, quant_bias)
- fp8_linear.py    Fp8Linear: float8_e4m3fn weights and activations, one torch._scaled_mm (`--quantization fp8`,
                   or an FP8 checkpoint's own tensors)
- fp8_block_linear.py  Fp8BlockLinear: block-wise FP8 (Qwen's / DeepSeek's weight_block_size checkpoints)
- fp8_checkpoint.py  FP8 checkpoints (compressed-tensors, block-wise "fp8"; config.json's quantization_config)
- fp8_parts.py     a checkpoint's FP8 projection parts read into Fp8Linear / Fp8BlockLinear (dense and per expert)
- fp8_device.py    whether a device runs FP8 (CUDA compute capability >= 8.9, a probe of each scale layout)
- npu_quant_linear.py  NpuInt8Linear (W8A16) and NpuInt8DynamicLinear (W8A8): the int8 linears on torch_npu's kernels
- npu_int4_linear.py   NpuInt4Linear (W4A16): Int4Linear's codes on torch_npu's npu_convert_weight_to_int4pack
                       + npu_weight_quant_batchmatmul (per-group scale and offset)
- npu_static_w8a8.py   NpuStaticW8A8Linear: msModelSlim's static W8A8 on torch_npu's npu_quantize + npu_quant_matmul
- cuda_quant_linear.py CudaInt8Linear (W8A16) on CUDA: the int8 linear on a Triton GEMM, and its start-up check
- cuda_int4_linear.py  CudaInt4Linear (W4A16) on CUDA: the int4 linear on a Triton GEMM, and its start-up check
- fusion.py    fused parts (QKV, gate-up) into one weight and bias, for every method
- experts.py   ExpertShard: a MoE layer's router and one tensor-parallel rank's share of its experts
- expert_linears.py  the experts' weights, one projection per expert, held by the dense linears' method
- per_expert.py    MoE experts stored one module each (the FP8 checkpoints' layout), read per rank
- shard_loader.py  the decoder layers read from the safetensors files, one tensor-parallel rank's slices only
- rotary.py    RotaryTable: M-RoPE cos/sin of every position, gathered per token once a step
- forward.py   LeanLM: the layer loop over packed tokens (LayerOps between the matmuls, paged
               attention, KV-connector hooks, DeepStack), no host decision per layer
"""
