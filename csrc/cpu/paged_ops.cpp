// CPU kernels of epdserve's paged-KV operators (schemas in csrc/registration.cpp).
//
// Cache layout, shared with the engine: key_cache / value_cache [num_blocks, block_size,
// kv_heads, head_dim], contiguous; token p of a request lives at block table[p / block_size],
// offset p % block_size. The attention kernels read the blocks where they lie (no gather):
// one work unit is (request or query token, kv head), whose G = heads / kv_heads query heads
// share every K/V row read (with AVX2+FMA, fp32 scores of 4 heads share each K load). Scores and
// outputs accumulate in fp32 whatever the cache dtype.
// Work is split with at::parallel_for, i.e. over the calling thread's torch thread count, so a
// co-located stage's operator runs only on that stage's threads (the CPU form of a core limit).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace epdserve {
namespace {

void check_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache must have key_cache's shape");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "key and value caches differ in dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV cache must be contiguous");
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64");
}

// ------------------------------------------------------------------ reshape_and_cache
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slots) {
  check_cache(key_cache, value_cache);
  check_index(slots, "slots");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), "key does not fit the cache");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
              "key/value dtype differs from the cache's");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == key.size(0), "one slot per token");
  const auto k = key.contiguous();
  const auto v = value.contiguous();
  const auto s = slots.contiguous();
  const int64_t tokens = k.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range 0..", num_slots - 1);
  }
  const size_t row = static_cast<size_t>(k.size(1) * k.size(2)) * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * row, kp + t * row, row);
      std::memcpy(vc + sp[t] * row, vp + t * row, row);
    }
  });
}

// ------------------------------------------------------------------ attention core
// One unit: G query heads (rows of q, already scaled, fp32) against n cached tokens of one kv
// head; positions come from `table` (block ids). Writes G x D outputs.
template <typename T>
struct Cache {
  const T* k;
  const T* v;
  int64_t block_size, kv_heads, head_dim;

  inline const T* key(const int64_t* table, int64_t p, int64_t h) const {
    return k + ((table[p / block_size] * block_size + p % block_size) * kv_heads + h) * head_dim;
  }
  inline const T* value(const int64_t* table, int64_t p, int64_t h) const {
    return v + ((table[p / block_size] * block_size + p % block_size) * kv_heads + h) * head_dim;
  }
};

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float w, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += w * static_cast<float>(v[i]);
}

// Scores of `rows` query rows (fp32, scaled) against one K row; 4 rows share each K load.
template <typename T>
inline void score_rows(const float* q, const T* k, int64_t rows, int64_t d, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) out[r * out_stride] = dot(q + r * d, k, d);
}

#if defined(__AVX2__) && defined(__FMA__)
template <>
inline void score_rows<float>(const float* q, const float* k, int64_t rows, int64_t d, float* out,
                              int64_t out_stride) {
  int64_t r = 0;
  if (d % 8 == 0) {
    for (; r + 4 <= rows; r += 4) {
      const float* q0 = q + r * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 kv = _mm256_loadu_ps(k + c);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + c), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d + c), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * d + c), kv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * d + c), kv, a3);
      }
      const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      alignas(16) float sums[4];
      _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
      for (int64_t i = 0; i < 4; ++i) out[(r + i) * out_stride] = sums[i];
    }
  }
  for (; r < rows; ++r) out[r * out_stride] = dot(q + r * d, k, d);
}
#endif

// Scratch of one thread: q rows, scores, accumulators.
struct Scratch {
  std::vector<float> q, scores, acc;
};

// Attend `rows` query heads (s.q, fp32, scaled) of one kv head `h` to the first n cached tokens
// of `table`. Writes rows x D outputs at out, row stride out_row_stride.
template <typename T>
void attend(const Cache<T>& c, const int64_t* table, int64_t h, int64_t rows, int64_t n, Scratch& s, T* out,
            int64_t out_row_stride) {
  const int64_t d = c.head_dim;
  s.scores.resize(static_cast<size_t>(rows * n));
  float* sc = s.scores.data();
  for (int64_t p = 0; p < n; ++p) score_rows(s.q.data(), c.key(table, p, h), rows, d, sc + p, n);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = sc + r * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n; ++p) m = std::max(m, row[p]);
    float sum = 0.f;
    for (int64_t p = 0; p < n; ++p) {
      row[p] = std::exp(row[p] - m);
      sum += row[p];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t p = 0; p < n; ++p) row[p] *= inv;
  }
  s.acc.assign(static_cast<size_t>(rows * d), 0.f);
  for (int64_t p = 0; p < n; ++p) {
    const T* vp = c.value(table, p, h);
    for (int64_t r = 0; r < rows; ++r) axpy(sc[r * n + p], vp, s.acc.data() + r * d, d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + r * out_row_stride;
    const float* a = s.acc.data() + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(a[i]);
  }
}

template <typename T>
void load_q(const T* q, int64_t rows, int64_t row_stride, int64_t d, float scale, Scratch& s) {
  s.q.resize(static_cast<size_t>(rows * d));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < d; ++i) s.q[r * d + i] = static_cast<float>(q[r * row_stride + i]) * scale;
}

void check_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_cache(key_cache, value_cache);
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query dtype differs from the cache's");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query head_dim differs from the cache's");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of kv_heads");
}

// ------------------------------------------------------------------ decode
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& ctx_lens, double scale) {
  check_attention(query, key_cache, value_cache);
  check_index(block_tables, "block_tables");
  check_index(ctx_lens, "ctx_lens");
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch, "block_tables must be [batch, max_blocks]");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.size(0) == batch, "ctx_lens must be [batch]");
  const int64_t kv_heads = key_cache.size(2), bs = key_cache.size(1), max_blocks = block_tables.size(1);
  const int64_t group = heads / kv_heads;
  const auto q = query.contiguous();
  const auto bt = block_tables.contiguous();
  const auto cl = ctx_lens.contiguous();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* clp = cl.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(clp[b] >= 0 && clp[b] <= max_blocks * bs, "ctx_lens[", b, "] = ", clp[b], " exceeds its block table");
    for (int64_t i = 0; i < (clp[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(btp[b * max_blocks + i] >= 0 && btp[b * max_blocks + i] < key_cache.size(0), "block id out of range");
  }
  at::Tensor out = at::empty({batch, heads, d}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    const Cache<scalar_t> c{key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), bs, kv_heads, d};
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch s;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / kv_heads, h = u % kv_heads;
        const int64_t first = (b * heads + h * group) * d;
        load_q(qp + first, group, d, d, static_cast<float>(scale), s);
        attend(c, btp + b * max_blocks, h, group, clp[b], s, op + first, d);
      }
    });
  });
  return out;
}

// ------------------------------------------------------------------ a later prefill chunk
at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& block_table, int64_t ctx_len,
                                   double scale) {
  check_attention(query, key_cache, value_cache);
  check_index(block_table, "block_table");
  const int64_t q_len = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t kv_heads = key_cache.size(2), bs = key_cache.size(1);
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(block_table.dim() == 1, "block_table must be [num_blocks]");
  TORCH_CHECK(q_len <= ctx_len && ctx_len <= block_table.size(0) * bs, "need q_len <= ctx_len <= table capacity");
  const auto q = query.contiguous();
  const auto bt = block_table.contiguous();
  const int64_t* btp = bt.data_ptr<int64_t>();
  for (int64_t i = 0; i < (ctx_len + bs - 1) / bs; ++i)
    TORCH_CHECK(btp[i] >= 0 && btp[i] < key_cache.size(0), "block id out of range");
  at::Tensor out = at::empty({q_len, heads, d}, query.options());
  const int64_t first_pos = ctx_len - q_len;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_prefill_attention", [&] {
    const Cache<scalar_t> c{key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), bs, kv_heads, d};
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, q_len * kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch s;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t i = u / kv_heads, h = u % kv_heads;
        const int64_t first = (i * heads + h * group) * d;
        load_q(qp + first, group, d, d, static_cast<float>(scale), s);
        attend(c, btp, h, group, first_pos + i + 1, s, op + first, d);  // causal: up to its own position
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(epdserve, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

}  // namespace epdserve
