// CPU kernels of the fused element-wise operators of one LM layer (schemas in
// csrc/registration.cpp; the Python side and the contract: epdserve/ops/native_layer_ops.py,
// epdserve/ops/layer_ops.py):
//   fused_add_rms_norm  residual += x; x = RMSNorm(residual) * weight      (in place)
//   rms_norm            RMSNorm(x) * weight over the last dim               (Qwen3's q/k norms too)
//   rotary_embedding    q, k = x * cos + rotate_half(x) * sin               (in place)
//   silu_and_mul        silu(x[:, :I]) * x[:, I:]
// Arithmetic: torch's eager ops on the same dtype, which is what transformers runs, op for op:
// the same fp32 expressions (no FMA contraction where torch rounds a product first), every op
// that torch rounds to bf16 / fp16 rounded here too, the RMS variance in fp32 summed in the order
// of torch's own sum (below). So results are torch's bit for bit on x86 (tests/ops/
// test_layer_ops.py), except silu where torch's vectorized loop leaves elements to its scalar
// tail (std::exp instead of Sleef's: rarely one bf16 ulp).
// Vectorized with at::vec (the same Vectorized<float> torch's own kernels use, including its
// Sleef exp and its float -> bf16 rounding); work is split over tokens with at::parallel_for.

// at::vec picks its implementation from CPU_CAPABILITY_*, which torch sets per dispatch copy of
// its own kernels; an extension built with -march=native sets it from what the compiler targets.
// The namespace is our own, so these inline copies never meet torch's.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512 1
#define CPU_CAPABILITY epdserve_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2 1
#define CPU_CAPABILITY epdserve_avx2
#else
#define CPU_CAPABILITY epdserve_default
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

namespace epdserve {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kF = fVec::size();
constexpr int64_t kGrainElems = 32768;  // elements per parallel task: below it, one thread

inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

// A float vector the compiler may not fuse into an FMA with what follows: torch rounds each
// fp32 product before the sum (separate mul and add kernels), so must we.
inline fVec no_contract(fVec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return fVec(r);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  return fVec(r);
#else
  return v;
#endif
}

// Load kF elements as floats, store kF floats as T (rounded to nearest even, as torch does),
// round a float vector to T's precision (and back). `n < kF`: the first n only (a row's tail).
template <typename T>  // c10::BFloat16, c10::Half: at::vec's generic conversions
struct IO {
  using rVec = at::vec::Vectorized<T>;
  static inline fVec load(const T* p, int64_t n = kF) {
    return std::get<0>(at::vec::convert_to_float<T>(rVec::loadu(p, n)));
  }
  static inline void store(T* p, const fVec& v, int64_t n = kF) { at::vec::convert_from_float<T>(v, v).store(p, n); }
  static inline fVec round(const fVec& v) {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
  static inline float round(float v) { return static_cast<float>(static_cast<T>(v)); }
};

#if defined(CPU_CAPABILITY_AVX512)
// 16 half-width elements are one 256-bit load or store. at::vec's Vectorized<BFloat16> holds 32,
// so 16 of them would be a masked store, slow on this Zen 4 (a bf16 add+RMSNorm of 32 x 512 took
// 14.8 µs with them, 6.2 µs without); the conversions are torch's own.
template <typename T, __m256i (*to_half)(const __m512&), void (*to_float)(const __m256i&, __m512&)>
struct HalfIO {
  static inline fVec load(const T* p, int64_t n = kF) {
    const __m256i h = n == kF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                              : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    __m512 o;
    to_float(h, o);
    return fVec(o);
  }
  static inline void store_half(T* p, __m256i h, int64_t n) {
    if (n == kF) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    } else {
      _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), h);
    }
  }
  static inline void store(T* p, const fVec& v, int64_t n = kF) { store_half(p, to_half(v), n); }
  static inline fVec round(const fVec& v) {
    __m512 o;
    to_float(to_half(v), o);
    return fVec(o);
  }
  static inline float round(float v) { return static_cast<float>(static_cast<T>(v)); }
};

#if defined(__AVX512BF16__)
// VCVTNEPS2BF16 rounds to nearest even as torch's integer rounding does, in one instruction,
// but reads denormals as zero and keeps NaN payloads: vectors holding either take torch's path.
inline __m256i to_bf16(const __m512& v) {
  if (_mm512_fpclass_ps_mask(v, 0x20 | 0x01 | 0x80)) return at::vec::cvtfp32_bf16(v);  // denormal, qNaN, sNaN
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
}
#else
inline __m256i to_bf16(const __m512& v) { return at::vec::cvtfp32_bf16(v); }
#endif
inline __m256i to_fp16(const __m512& v) { return at::vec::cvtfp32_fp16(v); }

template <>
struct IO<c10::BFloat16> : HalfIO<c10::BFloat16, to_bf16, at::vec::cvtbf16_fp32> {};
template <>
struct IO<c10::Half> : HalfIO<c10::Half, to_fp16, at::vec::cvtfp16_fp32> {};
#endif

template <>
struct IO<float> {
  static inline fVec load(const float* p, int64_t n = kF) { return n == kF ? fVec::loadu(p) : fVec::loadu(p, n); }
  static inline void store(float* p, const fVec& v, int64_t n = kF) { v.store(p, n); }
  static inline fVec round(const fVec& v) { return no_contract(v); }
  static inline float round(float v) { return v; }
};

// float32, bfloat16, float16 (no double: the model never runs in it)
template <typename F>
inline void dispatch(at::ScalarType s, const char* name, F&& f) {
  switch (s) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, name, ": unsupported dtype ", s);
  }
}

// Rows of a tensor [..., d] whose last dim is contiguous and whose middle dims are contiguous
// with it (any stride on the first dim): a [T, H, d] view into a fused QKV output qualifies.
struct Rows {
  int64_t n = 0, inner = 1, outer_stride = 0, d = 0;
  inline int64_t offset(int64_t r) const { return (r / inner) * outer_stride + (r % inner) * d; }
};

bool rows_of(const at::Tensor& t, Rows& rows) {
  const int64_t dim = t.dim();
  if (dim < 1) return false;
  rows.d = t.size(dim - 1);
  if (t.numel() == 0) {
    rows.n = 0;
    return true;
  }
  if (t.stride(dim - 1) != 1 && rows.d != 1) return false;
  if (dim == 1) {
    rows.n = 1;
    rows.inner = 1;
    rows.outer_stride = rows.d;
    return true;
  }
  int64_t expected = rows.d;
  rows.inner = 1;
  for (int64_t i = dim - 2; i >= 1; --i) {
    if (t.size(i) != 1 && t.stride(i) != expected) return false;
    expected *= t.size(i);
    rows.inner *= t.size(i);
  }
  rows.n = t.size(0) * rows.inner;
  rows.outer_stride = t.size(0) == 1 ? expected : t.stride(0);
  return true;
}

void check_dtype(const at::Tensor& t, const char* what) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, what,
              " must be float32, bfloat16 or float16, got ", s);
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [", x.size(-1), "], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype ", weight.scalar_type(), " differs from x's ",
              x.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
}

// ------------------------------------------------------------------ RMSNorm
// transformers: h = x.float(); h * rsqrt(h.pow(2).mean(-1) + eps), rounded to T, times weight.
// torch's mean is its sum, then / d; the sum of squares here adds in the sum's order: its
// cascade_sum for a contiguous inner reduction (aten/src/ATen/native/cpu/SumKernel.cpp:
// vectorized_inner_sum -> row_sum -> multi_row_sum), over vectors of 8 floats (sum_stub has no
// AVX512 kernel: torch runs its AVX2 one even on an AVX512 CPU). So the variance, and with it
// every result, is bit-equal to torch's on x86 (checked for d = 4 .. 70000).

inline int64_t ceil_log2(int64_t x) {  // at::native::utils::CeilLog2
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// torch's row_sum: 4 interleaved partial sums over `size` items, each a cascade of blocks of
// 2^power groups (multi_row_sum, 4 levels); the items past the last group of 4 go into
// partial 0, then partials 1..3 are added to it in order.
template <typename Acc, typename Load>
inline Acc torch_row_sum(int64_t size, const Load& load) {
  constexpr int64_t ilp = 4, levels = 4;
  const int64_t groups = size / ilp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / levels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  Acc acc[levels][ilp];
  for (auto& level : acc)
    for (auto& a : level) a = Acc{};
  int64_t i = 0;
  while (i + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + load(i * ilp + k);
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) {
        acc[j][k] = acc[j][k] + acc[j - 1][k];
        acc[j - 1][k] = Acc{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + load(i * ilp + k);
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + acc[j][k];
  for (int64_t v = groups * ilp; v < size; ++v) acc[0][0] = acc[0][0] + load(v);
  for (int64_t k = 1; k < ilp; ++k) acc[0][0] = acc[0][0] + acc[0][k];
  return acc[0][0];
}

// torch's sum vector: 8 floats (GCC vector extension; one AVX register)
constexpr int64_t kSumLanes = 8;
typedef float f8 __attribute__((vector_size(kSumLanes * sizeof(float))));

template <typename V>
inline V rounded(V p) {  // a product the compiler may not fuse into an FMA with the add after it
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
  asm("" : "+x"(p));
#else
  asm("" : "+m"(p));
#endif
  return p;
}

template <typename T>
inline f8 load8(const T* p) {
  f8 v;
  for (int64_t k = 0; k < kSumLanes; ++k) v[k] = static_cast<float>(p[k]);
  return v;
}

template <>
inline f8 load8<float>(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// sum of float(p[i])^2 over one row, in torch's order (vectorized_inner_sum; rows shorter than
// one vector: scalar_inner_sum)
template <typename T>
inline float sum_of_squares(const T* p, int64_t d) {
  if (d < kSumLanes) {
    return torch_row_sum<float>(d, [&](int64_t k) {
      const float h = static_cast<float>(p[k]);
      return rounded(h * h);
    });
  }
  const int64_t nvec = d / kSumLanes;
  const f8 vacc = torch_row_sum<f8>(nvec, [&](int64_t v) {
    const f8 h = load8(p + v * kSumLanes);
    return rounded(h * h);
  });
  float acc = 0.f;
  for (int64_t k = nvec * kSumLanes; k < d; ++k) {
    const float h = static_cast<float>(p[k]);
    acc += rounded(h * h);
  }
  for (int64_t k = 0; k < kSumLanes; ++k) acc += vacc[k];
  return acc;
}

// out = round(round(h * rsqrt(sum(h^2) / d + eps)) * w), h = float(in); in and out may alias
template <typename T>
inline void norm_row(const T* in, T* out, const T* w, int64_t d, float eps) {
  const float var = sum_of_squares(in, d) / static_cast<float>(d);
  const fVec inv(1.f / std::sqrt(var + eps));
  for (int64_t i = 0; i < d; i += kF) {
    const int64_t n = std::min(kF, d - i);
    const fVec h = IO<T>::round(IO<T>::load(in + i, n) * inv);
    IO<T>::store(out + i, h * IO<T>::load(w + i, n), n);
  }
}

// residual = round(residual + x); x = norm(residual)
template <typename T>
inline void add_norm_row(T* x, T* r, const T* w, int64_t d, float eps) {
  for (int64_t i = 0; i < d; i += kF) {
    const int64_t n = std::min(kF, d - i);
    IO<T>::store(r + i, IO<T>::load(x + i, n) + IO<T>::load(r + i, n), n);
  }
  norm_row(r, x, w, d, eps);  // the row is in L1: reading it twice more costs little
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_dtype(x, "x");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ", residual.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual dtype differs from x's");
  check_weight(x, weight);
  Rows rx, rr;
  TORCH_CHECK(rows_of(x, rx) && rows_of(residual, rr),
              "fused_add_rms_norm writes in place: x and residual need a contiguous last dim (and middle dims)");
  const int64_t d = rx.d;
  const float feps = static_cast<float>(eps);
  dispatch(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rx.n, grain(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) add_norm_row(xp + rx.offset(t), rp + rr.offset(t), wp, d, feps);
    });
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_dtype(x_in, "x");
  check_weight(x_in, weight);
  Rows rx;
  const at::Tensor x = rows_of(x_in, rx) ? x_in : x_in.contiguous();
  if (!x.is_same(x_in)) rows_of(x, rx);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t d = rx.d;
  const float feps = static_cast<float>(eps);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rx.n, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) norm_row(xp + rx.offset(t), op + t * d, wp, d, feps);
    });
  });
  return out;
}

// ------------------------------------------------------------------ rotary (rotate-half)
// first half:  x1*c1 - x2*s1  (rotate_half's -x2, times sin, is -(x2*s1) exactly)
// second half: x2*c2 + x1*s2
template <typename T>
inline void rotate_head(T* x, const T* c, const T* s, int64_t half) {
  for (int64_t i = 0; i < half; i += kF) {
    const int64_t n = std::min(kF, half - i);
    const fVec x1 = IO<T>::load(x + i, n), x2 = IO<T>::load(x + half + i, n);
    const fVec c1 = IO<T>::load(c + i, n), c2 = IO<T>::load(c + half + i, n);
    const fVec s1 = IO<T>::load(s + i, n), s2 = IO<T>::load(s + half + i, n);
    IO<T>::store(x + i, IO<T>::round(x1 * c1) - IO<T>::round(x2 * s1), n);
    IO<T>::store(x + half + i, IO<T>::round(x2 * c2) + IO<T>::round(x1 * s2), n);
  }
}

void check_qk(const at::Tensor& t, const char* what, int64_t tokens, int64_t d) {
  TORCH_CHECK(t.dim() == 3, what, " must be [tokens, heads, head_dim], got ", t.sizes());
  TORCH_CHECK(t.size(0) == tokens && t.size(2) == d, what, " ", t.sizes(), " does not fit cos/sin [", tokens, ", ",
              d, "]");
  TORCH_CHECK(t.numel() == 0 || ((t.stride(2) == 1 || d == 1) && (t.stride(1) == d || t.size(1) == 1)), what,
              " needs contiguous heads and head_dim (any token stride)");
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(q, "q");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes(), "cos and sin must be [tokens, head_dim]");
  TORCH_CHECK(cos.numel() == 0 || (cos.stride(1) == 1 && sin.stride(1) == 1),
              "cos and sin need a contiguous last dim (any token stride)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share one dtype");
  const int64_t tokens = cos.size(0), d = cos.size(1);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even, got ", d);
  check_qk(q, "q", tokens, d);
  check_qk(k, "k", tokens, d);
  const int64_t hq = q.size(1), hk = k.size(1), half = d / 2;
  const int64_t qs = q.stride(0), ks = k.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  dispatch(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain((hq + hk) * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * cs;
        const scalar_t* s = sp + t * ss;
        for (int64_t h = 0; h < hq; ++h) rotate_head(qp + t * qs + h * d, c, s, half);
        for (int64_t h = 0; h < hk; ++h) rotate_head(kp + t * ks + h * d, c, s, half);
      }
    });
  });
}

// ------------------------------------------------------------------ SiLU-and-mul
// torch's silu: x / (1 + exp(-x)) in float (Sleef exp on its vectorized part; its loop takes
// 2 * Vectorized<T>::size() elements at a time and leaves the rest to std::exp), rounded to T;
// then the product, rounded to T.
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t inter) {
  const int64_t step = 2 * at::vec::Vectorized<T>::size();
  const int64_t vec_end = inter - inter % step;
  const fVec one(1.f);
  for (int64_t i = 0; i < vec_end; i += kF) {
    const fVec x = IO<T>::load(g + i);
    const fVec sx = IO<T>::round(x / (one + x.neg().exp()));
    IO<T>::store(o + i, sx * IO<T>::load(u + i));
  }
  for (int64_t i = vec_end; i < inter; ++i) {
    const float x = static_cast<float>(g[i]);
    const float sx = IO<T>::round(x / (1.f + std::exp(-x)));
    o[i] = static_cast<T>(sx * static_cast<float>(u[i]));
  }
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_dtype(x_in, "x");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "x must be [..., 2 * intermediate], got ", x_in.sizes());
  Rows rx;
  const at::Tensor x = rows_of(x_in, rx) ? x_in : x_in.contiguous();
  if (!x.is_same(x_in)) rows_of(x, rx);
  const int64_t inter = rx.d / 2;
  auto shape = x.sizes().vec();
  shape.back() = inter;
  at::Tensor out = at::empty(shape, x.options());
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rx.n, grain(2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = xp + rx.offset(t);
        silu_mul_row(g, g + inter, op + t * inter, inter);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(epdserve, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}

}  // namespace epdserve
