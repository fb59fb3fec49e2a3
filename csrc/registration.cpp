// The `epdserve` operator namespace: schemas (with mutability annotations) of the paged-KV
// operators and of an LM layer's fused element-wise ones. Kernels: csrc/cpu/ (C++); the NPU
// calls torch_npu's kernels (epdserve/ops/npu_ops.py); shape functions for tracing:
// epdserve/ops/native.py and native_layer_ops.py.

#include <torch/library.h>

TORCH_LIBRARY(epdserve, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "int ctx_len, float scale) -> Tensor");
  // LM layer (csrc/cpu/layer_ops.cpp): residual += x, x = RMSNorm(residual) * weight, in place
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // q [T, H, d], k [T, KVH, d], cos / sin [T, d] (each: any token stride): rotate-half, in place
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}
