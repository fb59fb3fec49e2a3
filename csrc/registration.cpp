// The `epdserve` operator namespace: schemas (with mutability annotations) of the paged-KV
// operators. Kernels: csrc/cpu/ (C++); the NPU calls torch_npu's kernels (epdserve/ops/npu_ops.py);
// shape functions for tracing: epdserve/ops/native.py.

#include <torch/library.h>

TORCH_LIBRARY(epdserve, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()");
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "int ctx_len, float scale) -> Tensor");
}
