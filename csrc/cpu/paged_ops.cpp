// CPU kernels of epdserve's paged-KV operators (schemas in csrc/registration.cpp).
//
// Cache layout, shared with the engine: key_cache / value_cache [num_blocks, block_size,
// kv_heads, head_dim], contiguous; token p of a request lives at block table[p / block_size],
// offset p % block_size. The attention kernels read the blocks where they lie (no gather):
// one work unit is (request or query token, kv head), whose G = heads / kv_heads query heads
// share every K/V row read (up to 4 heads per pass, vectorized with at::vec). Scores and
// outputs accumulate in fp32 whatever the cache dtype; the rounding follows torch's CPU flash
// attention (see "attention core").
// Work is split with at::parallel_for, i.e. over the calling thread's torch thread count, so a
// co-located stage's operator runs only on that stage's threads (the CPU form of a core limit).

// at::vec for the CPU this library is built for (-march=native): torch compiles its own kernels
// once per capability with these macros; the same headers give us its fast vector exp (fexp_u20) and
// its bf16/fp16 conversions (round to nearest even), so the values match aten's bit for bit.
#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EPDSERVE_X86_FMA 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>


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
// One unit: G query heads (rows) of one request (or query token) against its first n cached
// tokens of one kv head, the G heads sharing every K/V row load (GQA). The arithmetic follows
// aten's CPU flash attention (FlashAttentionKernel.cpp, `cpu_flash_attention`), which torch's
// SDPA runs for a query of one token on CPU, so that reduced-precision results round like it:
//   per KV split of kSplit (512) tokens: s = q.k accumulated in fp32 (q not prescaled), then
//   s *= scale; m = max(m_old, max s); e = fexp_u20(s - m) (at::vec's fast exp, relative error
//   ~1e-4, which is what torch 2.13 runs: std::exp or exp_u20 there round ~2 % of the
//   exps to another bf16; the tail of a split that is not a multiple of the vector width: std::exp;
//   fp32 uses the accurate vector exp);
//   sum = sum(e) + exp(m_old - m) * sum_old; acc *= exp(m_old - m); e rounded to the cache dtype
//   (bf16/fp16) before P.V, accumulated in fp32 and added to acc; at the end
//   out = dtype(acc * (1 / sum)).
// For bf16/fp16 the two dot products also follow the summation order of torch's BLAS call
// (qk_rows_ordered / pv_rows_ordered), so outputs equal torch's SDPA bit for bit within one KV
// split. fp32 shares the q.k kernel (its layout is also the fast one) but sums P.V token by token
// and uses the accurate exp: within 1e-5 of torch, as before.
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kSplit = 512;  // aten's kvSplitSize

template <typename T>
inline Vec load_f(const T* p) {
  if constexpr (at::is_reduced_floating_point_v<T>) {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  } else {  // double: not a fast path
    alignas(64) float f[Vec::size()];
    for (int64_t i = 0; i < Vec::size(); ++i) f[i] = static_cast<float>(p[i]);
    return Vec::loadu(f);
  }
}
template <>
inline Vec load_f<float>(const float* p) {
  return Vec::loadu(p);
}

template <typename T>
inline void store_f(T* p, const Vec& v) {
  if constexpr (at::is_reduced_floating_point_v<T>) {
    at::vec::convert_from_float<T>(v, v).store(p, Vec::size());
  } else {
    alignas(64) float f[Vec::size()];
    v.store(f);
    for (int64_t i = 0; i < Vec::size(); ++i) p[i] = static_cast<T>(f[i]);
  }
}
template <>
inline void store_f<float>(float* p, const Vec& v) {
  v.store(p);
}

template <typename T>
struct Cache {
  const T* k;
  const T* v;
  int64_t block_size, kv_heads, head_dim;

  // Element offsets of the K/V rows of kv head h for positions p0 .. p0 + len - 1 (one division
  // per split, not one per row).
  inline void rows(const int64_t* table, int64_t p0, int64_t len, int64_t h, int64_t* out) const {
    int64_t blk = p0 / block_size, off = p0 % block_size;
    for (int64_t i = 0; i < len; ++i) {
      out[i] = ((table[blk] * block_size + off) * kv_heads + h) * head_dim;
      if (++off == block_size) off = 0, ++blk;
    }
  }
};

// Scratch of one thread (sized once per parallel chunk).
struct Scratch {
  std::vector<float> q, scores, acc, part;
  std::vector<int64_t> rows;  // K/V row offsets of the current split
  std::vector<char> probs;  // e rounded to T (reduced types), kSplit per row
  void reserve(int64_t rows, int64_t d, size_t elem) {
    q.resize(static_cast<size_t>(rows * d));
    scores.resize(static_cast<size_t>(rows * kSplit));
    acc.resize(static_cast<size_t>(rows * d));
    part.resize(static_cast<size_t>(rows * d));
    this->rows.resize(static_cast<size_t>(kSplit));
    probs.resize(static_cast<size_t>(rows * kSplit) * elem);
  }
};

// scores[r * kSplit + p] = q_r . k_p for p < len, R rows at a time sharing each K load.
template <typename T, int R>
inline void qk_rows(const Cache<T>& c, const int64_t* rows, int64_t len, const float* q,
                    float* sc) {
  const int64_t d = c.head_dim;
  constexpr int64_t W = Vec::size();
  const int64_t dv = d - d % W;
  for (int64_t p = 0; p < len; ++p) {
    const T* k = c.k + rows[p];
    Vec a[R];
    for (int r = 0; r < R; ++r) a[r] = Vec(0.f);
    for (int64_t i = 0; i < dv; i += W) {
      const Vec kv = load_f(k + i);
      for (int r = 0; r < R; ++r) a[r] = at::vec::fmadd(Vec::loadu(q + r * d + i), kv, a[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a[r]);
      for (int64_t i = dv; i < d; ++i) s += q[r * d + i] * static_cast<float>(k[i]);
      sc[r * kSplit + p] = s;
    }
  }
}

// part[r * d + i] = sum_p probs[r][p] * v_p[i] for i in [i0, i0 + C*W), R rows at a time.
template <typename T, typename P, int R, int C>
inline void pv_block(const Cache<T>& c, const int64_t* rows, int64_t len, const P* probs,
                     int64_t i0, float* part) {
  const int64_t d = c.head_dim;
  constexpr int64_t W = Vec::size();
  Vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) a[r][j] = Vec(0.f);
  for (int64_t p = 0; p < len; ++p) {
    const T* v = c.v + rows[p] + i0;
    Vec vv[C];
    for (int j = 0; j < C; ++j) vv[j] = load_f(v + j * W);
    for (int r = 0; r < R; ++r) {
      const Vec w(static_cast<float>(probs[r * kSplit + p]));
      for (int j = 0; j < C; ++j) a[r][j] = at::vec::fmadd(w, vv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) a[r][j].store(part + r * d + i0 + j * W);
}

template <typename T, typename P, int R>
inline void pv_rows(const Cache<T>& c, const int64_t* rows, int64_t len, const P* probs,
                    float* part) {
  const int64_t d = c.head_dim;
  constexpr int64_t W = Vec::size();
  const int64_t dv = d - d % W;
  int64_t i0 = 0;
  for (; i0 + 4 * W <= dv; i0 += 4 * W) pv_block<T, P, R, 4>(c, rows, len, probs, i0, part);
  for (; i0 + W <= dv; i0 += W) pv_block<T, P, R, 1>(c, rows, len, probs, i0, part);
  if (dv < d) {
    for (int r = 0; r < R; ++r)
      for (int64_t i = dv; i < d; ++i) part[r * d + i] = 0.f;
    for (int64_t p = 0; p < len; ++p) {
      const T* v = c.v + rows[p];
      for (int r = 0; r < R; ++r) {
        const float w = static_cast<float>(probs[r * kSplit + p]);
        for (int64_t i = dv; i < d; ++i) part[r * d + i] += w * static_cast<float>(v[i]);
      }
    }
  }
}

// The reduced-precision (bf16/fp16) dot products in the order of the BLAS call aten makes
// (MKL's bf16/fp16 GEMM with fp32 output, single-threaded inside aten's parallel region; the
// order was read off torch 2.13 + MKL with cancellation probes: an element of +2^12, one of
// -2^12 and one of 2^-12 sum to 0 or 2^-12 depending on which two meet first; checked bit for
// bit against SDPA by tests/ops/test_paged_ops.py::test_decode_bf16_equals_torch_sdpa).
// Products of two bf16/fp16 values are exact in fp32, so only the order of the sums matters:
//  q.k: four partial sums over head_dim, lane j taking elements j, j+4, j+8, ... in turn;
//       then (l0 + l2) + (l1 + l3).
//  P.V: per output element, tokens in groups of four, each group summed as
//       (x0 + x2) + (x1 + x3) and added to the running sum in order; the last len % 4 tokens
//       are then added one by one, last first.
#ifdef EPDSERVE_X86_FMA
template <typename T>
inline __m128 load4(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m128i x = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm_castsi128_ps(_mm_slli_epi32(x, 16));
  } else {
    return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
}

template <typename T, int R>
inline void qk_rows_ordered(const Cache<T>& c, const int64_t* rows, int64_t len,
                            const float* q, float* sc) {
  const int64_t d = c.head_dim;
  const int64_t d4 = d - d % 4;
  int64_t p = 0;
#ifdef __AVX512F__
  // Four tokens at a time: a zmm holds the four partial sums of each of four tokens; the K
  // rows' 4-element pieces are transposed into place (shuffles), so each FMA serves four
  // tokens. The order per token is the same as below.
  if (d % 16 == 0) {
    for (; p + 4 <= len; p += 4) {
      const T* k0 = c.k + rows[p];
      const T* k1 = c.k + rows[p + 1];
      const T* k2 = c.k + rows[p + 2];
      const T* k3 = c.k + rows[p + 3];
      __m512 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        __m512 kz[4];
        if constexpr (std::is_same_v<T, float>) {  // 4x4 transpose of 128-bit pieces
          const __m512 z0 = _mm512_loadu_ps(k0 + i), z1 = _mm512_loadu_ps(k1 + i);
          const __m512 z2 = _mm512_loadu_ps(k2 + i), z3 = _mm512_loadu_ps(k3 + i);
          const __m512 b0 = _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(1, 0, 1, 0));
          const __m512 b1 = _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 2, 3, 2));
          const __m512 b2 = _mm512_shuffle_f32x4(z2, z3, _MM_SHUFFLE(1, 0, 1, 0));
          const __m512 b3 = _mm512_shuffle_f32x4(z2, z3, _MM_SHUFFLE(3, 2, 3, 2));
          kz[0] = _mm512_shuffle_f32x4(b0, b2, _MM_SHUFFLE(2, 0, 2, 0));
          kz[1] = _mm512_shuffle_f32x4(b0, b2, _MM_SHUFFLE(3, 1, 3, 1));
          kz[2] = _mm512_shuffle_f32x4(b1, b3, _MM_SHUFFLE(2, 0, 2, 0));
          kz[3] = _mm512_shuffle_f32x4(b1, b3, _MM_SHUFFLE(3, 1, 3, 1));
        } else {  // 4x4 transpose of 64-bit pieces, then widen
          const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + i));
          const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1 + i));
          const __m256i y2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k2 + i));
          const __m256i y3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k3 + i));
          const __m256i a0 = _mm256_unpacklo_epi64(y0, y1), a1 = _mm256_unpackhi_epi64(y0, y1);
          const __m256i a2 = _mm256_unpacklo_epi64(y2, y3), a3 = _mm256_unpackhi_epi64(y2, y3);
          const __m256i z[4] = {_mm256_permute2x128_si256(a0, a2, 0x20), _mm256_permute2x128_si256(a1, a3, 0x20),
                                _mm256_permute2x128_si256(a0, a2, 0x31), _mm256_permute2x128_si256(a1, a3, 0x31)};
          for (int j = 0; j < 4; ++j) {
            if constexpr (std::is_same_v<T, at::BFloat16>)
              kz[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(z[j]), 16));
            else
              kz[j] = _mm512_cvtph_ps(z[j]);
          }
        }
        for (int j = 0; j < 4; ++j) {
          for (int r = 0; r < R; ++r)
            a[r] = _mm512_fmadd_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(q + r * d + i + 4 * j)), kz[j], a[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_add_ps(a[r], _mm512_permute_ps(a[r], _MM_SHUFFLE(1, 0, 3, 2)));  // l0+l2, l1+l3
        const __m512 y = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
        alignas(64) float t[16];
        _mm512_store_ps(t, y);
        float* o = sc + r * kSplit + p;
        o[0] = t[0], o[1] = t[4], o[2] = t[8], o[3] = t[12];
      }
    }
  }
#endif
  for (; p < len; ++p) {
    const T* k = c.k + rows[p];
    __m128 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm_setzero_ps();
    for (int64_t i = 0; i < d4; i += 4) {
      const __m128 kv = load4(k + i);
      for (int r = 0; r < R; ++r) a[r] = _mm_fmadd_ps(_mm_loadu_ps(q + r * d + i), kv, a[r]);
    }
    for (int r = 0; r < R; ++r) {
      alignas(16) float l[4];
      _mm_store_ps(l, a[r]);
      for (int64_t i = d4; i < d; ++i) l[i - d4] += q[r * d + i] * static_cast<float>(k[i]);
      sc[r * kSplit + p] = (l[0] + l[2]) + (l[1] + l[3]);
    }
  }
}
#else
template <typename T, int R>
inline void qk_rows_ordered(const Cache<T>& c, const int64_t* rows, int64_t len,
                            const float* q, float* sc) {
  const int64_t d = c.head_dim;
  for (int64_t p = 0; p < len; ++p) {
    const T* k = c.k + rows[p];
    for (int r = 0; r < R; ++r) {
      float l[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < d; ++i) l[i % 4] = std::fma(q[r * d + i], static_cast<float>(k[i]), l[i % 4]);
      sc[r * kSplit + p] = (l[0] + l[2]) + (l[1] + l[3]);
    }
  }
}
#endif

template <typename T, int R, int C>
inline void pv_block_ordered(const Cache<T>& c, const int64_t* rows, int64_t len,
                             const T* probs, int64_t i0, float* part, bool accumulate) {
  const int64_t d = c.head_dim;
  constexpr int64_t W = Vec::size();
  Vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) a[r][j] = accumulate ? Vec::loadu(part + r * d + i0 + j * W) : Vec(0.f);
  const int64_t len4 = len - len % 4;
  for (int64_t p = 0; p < len4; p += 4) {
    const T* v0 = c.v + rows[p] + i0;
    const T* v1 = c.v + rows[p + 1] + i0;
    const T* v2 = c.v + rows[p + 2] + i0;
    const T* v3 = c.v + rows[p + 3] + i0;
    for (int j = 0; j < C; ++j) {
      const Vec x0 = load_f(v0 + j * W), x1 = load_f(v1 + j * W), x2 = load_f(v2 + j * W),
                x3 = load_f(v3 + j * W);
      for (int r = 0; r < R; ++r) {
        const T* pr = probs + r * kSplit + p;
        const Vec s02 = at::vec::fmadd(Vec(static_cast<float>(pr[0])), x0, Vec(static_cast<float>(pr[2])) * x2);
        const Vec s13 = at::vec::fmadd(Vec(static_cast<float>(pr[1])), x1, Vec(static_cast<float>(pr[3])) * x3);
        a[r][j] = a[r][j] + (s02 + s13);
      }
    }
  }
  for (int64_t p = len - 1; p >= len4; --p) {
    const T* v = c.v + rows[p] + i0;
    for (int j = 0; j < C; ++j) {
      const Vec x = load_f(v + j * W);
      for (int r = 0; r < R; ++r) a[r][j] = at::vec::fmadd(Vec(static_cast<float>(probs[r * kSplit + p])), x, a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) a[r][j].store(part + r * d + i0 + j * W);
}

template <typename T, int R>
inline void pv_rows_ordered(const Cache<T>& c, const int64_t* rows, int64_t len,
                            const T* probs, float* part, bool accumulate) {
  const int64_t d = c.head_dim;
  constexpr int64_t W = Vec::size();
  const int64_t dv = d - d % W;
  int64_t i0 = 0;
  for (; i0 + 4 * W <= dv; i0 += 4 * W) pv_block_ordered<T, R, 4>(c, rows, len, probs, i0, part, accumulate);
  for (; i0 + W <= dv; i0 += W) pv_block_ordered<T, R, 1>(c, rows, len, probs, i0, part, accumulate);
  const int64_t len4 = len - len % 4;
  for (int r = 0; r < R; ++r) {
    const T* pr = probs + r * kSplit;
    for (int64_t i = dv; i < d; ++i) {
      float acc = accumulate ? part[r * d + i] : 0.f;
      for (int64_t p = 0; p < len4; p += 4) {
        const float x0 = static_cast<float>(pr[p]) * static_cast<float>(c.v[rows[p] + i]);
        const float x1 = static_cast<float>(pr[p + 1]) * static_cast<float>(c.v[rows[p + 1] + i]);
        const float x2 = static_cast<float>(pr[p + 2]) * static_cast<float>(c.v[rows[p + 2] + i]);
        const float x3 = static_cast<float>(pr[p + 3]) * static_cast<float>(c.v[rows[p + 3] + i]);
        acc = acc + ((x0 + x2) + (x1 + x3));
      }
      for (int64_t p = len - 1; p >= len4; --p)
        acc = acc + static_cast<float>(pr[p]) * static_cast<float>(c.v[rows[p] + i]);
      part[r * d + i] = acc;
    }
  }
}

// Softmax update of one row over one split (aten's _mul_reduce_max / _exp_reduce_sum fusion
// kernels): scales the scores in place, writes e = exp(s - m) to probs (as P), returns the
// factor exp(m_old - m) that the accumulator must be multiplied by.
template <typename P>
inline float softmax_split(float* row, int64_t len, float scale, float& mx, float& sum, P* probs) {
  constexpr int64_t W = Vec::size();
  const int64_t lv = len - len % W;
  const Vec vscale(scale);
  Vec vmax(-std::numeric_limits<float>::infinity());
  float tmax = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < lv; i += W) {
    const Vec x = Vec::loadu(row + i) * vscale;
    vmax = at::vec::maximum(vmax, x);
    x.store(row + i);
  }
  for (int64_t i = lv; i < len; ++i) {
    row[i] = row[i] * scale;
    tmax = std::max(tmax, row[i]);
  }
  tmax = std::max(tmax, at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax));
  tmax = mx > tmax ? mx : tmax;
  if (tmax == -std::numeric_limits<float>::infinity()) {
    for (int64_t i = 0; i < len; ++i) probs[i] = static_cast<P>(0.f);
    return 1.f;
  }
  const Vec vm(tmax);
  Vec vsum(0.f);
  for (int64_t i = 0; i < lv; i += W) {
    const Vec x = Vec::loadu(row + i) - vm;
    const Vec e = at::is_reduced_floating_point_v<P> ? x.fexp_u20() : x.exp();  // fp32: accurate exp
    vsum = vsum + e;
    store_f(probs + i, e);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (int64_t i = lv; i < len; ++i) {
    const float e = std::exp(row[i] - tmax);
    s += e;
    probs[i] = static_cast<P>(e);
  }
  const float rescale = std::exp(mx - tmax);
  sum = s + rescale * sum;
  mx = tmax;
  return rescale;
}

// Attend `rows` query heads (q rows at `q`, row stride q_stride) of kv head `h` to the first n
// cached tokens of `table`; writes rows x D outputs at out (row stride out_stride).
template <typename T, int R>
void attend_rows(const Cache<T>& c, const int64_t* table, int64_t h, const T* q, int64_t q_stride, int64_t n,
                 float scale, Scratch& s, T* out, int64_t out_stride) {
  // P: what P.V multiplies, e rounded to T for the reduced types as aten does (fp32 stays fp32)
  using P = T;
  const int64_t d = c.head_dim;
  float* qf = s.q.data();
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] = static_cast<float>(q[r * q_stride + i]);
  float* sc = s.scores.data();
  float* acc = s.acc.data();
  P* probs = reinterpret_cast<P*>(s.probs.data());
  float mx[R], sum[R], rescale[R];
  for (int r = 0; r < R; ++r) mx[r] = -std::numeric_limits<float>::infinity(), sum[r] = 0.f;
  float* pt = s.part.data();  // a later split's P.V, added to acc after rescaling
  for (int64_t p0 = 0; p0 < n; p0 += kSplit) {
    const int64_t len = std::min(kSplit, n - p0);
    int64_t* rows = s.rows.data();
    c.rows(table, p0, len, h, rows);
    if constexpr (at::is_reduced_floating_point_v<T> || std::is_same_v<T, float>)
      qk_rows_ordered<T, R>(c, rows, len, qf, sc);  // fp32: the same layout is the fast one too
    else
      qk_rows<T, R>(c, rows, len, qf, sc);
    for (int r = 0; r < R; ++r)
      rescale[r] = softmax_split(sc + r * kSplit, len, scale, mx[r], sum[r], probs + r * kSplit);
    if constexpr (at::is_reduced_floating_point_v<T>) {
      // as aten: acc *= exp(m_old - m), then the GEMM with beta = 1 sums this split onto it
      if (p0 > 0) {
        for (int r = 0; r < R; ++r) {
          const Vec f(rescale[r]);
          int64_t i = 0;
          for (; i + Vec::size() <= d; i += Vec::size()) (Vec::loadu(acc + r * d + i) * f).store(acc + r * d + i);
          for (; i < d; ++i) acc[r * d + i] = acc[r * d + i] * rescale[r];
        }
      }
      pv_rows_ordered<T, R>(c, rows, len, probs, acc, p0 > 0);
    } else {
      pv_rows<T, P, R>(c, rows, len, probs, p0 == 0 ? acc : pt);
      if (p0 > 0) {
        constexpr int64_t W = Vec::size();
        for (int r = 0; r < R; ++r) {
          const Vec f(rescale[r]);
          int64_t i = 0;
          for (; i + W <= d; i += W)
            (Vec::loadu(pt + r * d + i) + Vec::loadu(acc + r * d + i) * f).store(acc + r * d + i);
          for (; i < d; ++i) acc[r * d + i] = pt[r * d + i] + acc[r * d + i] * rescale[r];
        }
      }
    }
  }
  constexpr int64_t W = Vec::size();
  for (int r = 0; r < R; ++r) {
    const float inv = 1.f / (sum[r] == 0.f ? 1.f : sum[r]);
    const Vec vinv(inv);
    T* o = out + r * out_stride;
    int64_t i = 0;
    for (; i + W <= d; i += W) store_f(o + i, Vec::loadu(acc + r * d + i) * vinv);
    for (; i < d; ++i) o[i] = static_cast<T>(acc[r * d + i] * inv);
  }
}

template <typename T>
void attend(const Cache<T>& c, const int64_t* table, int64_t h, const T* q, int64_t rows, int64_t n, float scale,
            Scratch& s, T* out) {
  const int64_t d = c.head_dim;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) attend_rows<T, 4>(c, table, h, q + r * d, d, n, scale, s, out + r * d, d);
  switch (rows - r) {
    case 3: attend_rows<T, 3>(c, table, h, q + r * d, d, n, scale, s, out + r * d, d); break;
    case 2: attend_rows<T, 2>(c, table, h, q + r * d, d, n, scale, s, out + r * d, d); break;
    case 1: attend_rows<T, 1>(c, table, h, q + r * d, d, n, scale, s, out + r * d, d); break;
    default: break;
  }
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
      s.reserve(std::min<int64_t>(group, 4), d, sizeof(scalar_t));
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / kv_heads, h = u % kv_heads;
        const int64_t first = (b * heads + h * group) * d;
        attend(c, btp + b * max_blocks, h, qp + first, group, clp[b], static_cast<float>(scale), s, op + first);
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
      s.reserve(std::min<int64_t>(group, 4), d, sizeof(scalar_t));
      for (int64_t u = begin; u < end; ++u) {
        const int64_t i = u / kv_heads, h = u % kv_heads;
        const int64_t first = (i * heads + h * group) * d;
        // causal: up to its own position
        attend(c, btp, h, qp + first, group, first_pos + i + 1, static_cast<float>(scale), s, op + first);
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
