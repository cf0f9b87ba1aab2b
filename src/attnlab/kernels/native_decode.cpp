// The kernels of a decoding step besides its matrix-vector products:
//
//   decode_attention  z = softmax(q k^T scale + mask) v for a few queries over the cached keys
//                     (grouped-query heads read each key once for the whole group)
//   paged_attention   the same over keys kept in fixed-size pages (a serving engine's cache),
//                     read through each row's block table where they lie: no gather
//   argmax_rows       the greedy choice: the first index of each row's maximum (NaN first)
//   rms_norm          x / sqrt(mean(x^2) + eps) * w, rounded as the written-out formula rounds
//   rotary            x * cos + turn(x) * sin on the first R features of each head (RoPE)
//   activation        act(g), or act(g) * up rounded as the written-out product rounds, for
//                     silu and the tanh GELU (in one pass; PyTorch's tanh GELU costs 5x its
//                     exact one)
//
// A decoding step calls each of them once per layer or once per token on small tensors, where
// PyTorch's general kernels cost more than the arithmetic: its CPU attention sets up tiles for
// long queries, its argmax reduces a 150k-entry row on one thread without vector loads. Sums,
// softmax and the greedy comparison are in float32 for float32 and bfloat16 inputs alike.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "native_lanes.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// exp(x) = 2^n p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p Cephes' expf
// polynomial (within 2 ulp of expf); below -87.3 (where expf underflows) 0, so a -inf score
// weighs exactly nothing. The numbers of both vector loops below.
constexpr float kExpLow = -87.3f, kExpHigh = 88.7f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpFirst = 1.9875691500e-4f;  // p's leading coefficient, then kExpNext
constexpr float kExpNext[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                              1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
// exp(x) for 16 floats (kExpLow ... above).
inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpFirst);
  for (const float c : kExpNext) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp16 for 8 floats. Without scalef, 2^n is written into a float's exponent bits, in two
// factors 2^(n/2) 2^(n - n/2): n reaches 128 (x up to 88.7, p < 1), past one exponent's range.
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpFirst);
  for (const float c : kExpNext) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
  const auto power = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  p = _mm256_mul_ps(_mm256_mul_ps(p, power(half)), power(_mm256_sub_epi32(whole, half)));
  return _mm256_and_ps(live, p);
}
#endif

// row[j] = exp(row[j] - top) for j in [lo, S); returns their sum.
inline float exp_shifted(float* row, int64_t lo, int64_t S, float top) {
  float sum = 0.f;
  int64_t j = lo;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (; j + 16 <= S; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
    _mm512_storeu_ps(row + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (; j + 8 <= S; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
    _mm256_storeu_ps(row + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = attnlab_lanes::sum8(acc);
#endif
  for (; j < S; ++j) {
    row[j] = std::exp(row[j] - top);
    sum += row[j];
  }
  return sum;
}

// Keys and values of a dense cache: B x G x S x D views with any strides, every key present.
template <typename T>
struct DenseKeys {
  const T *kp, *vp;
  at::IntArrayRef ks, vs;
  int64_t first(int64_t) const { return 0; }
  const T* key(int64_t b, int64_t g, int64_t j) const { return kp + b * ks[0] + g * ks[1] + j * ks[2]; }
  const T* value(int64_t b, int64_t g, int64_t j) const { return vp + b * vs[0] + g * vs[1] + j * vs[2]; }
};

// Keys and values in pages (N x G x P x D): row b's key j (j >= first[b]) is its token
// t = j - first[b], slot t % P of page tables[b][t / P]; keys before first[b] do not exist.
template <typename T>
struct PagedKeys {
  const T *kp, *vp;
  at::IntArrayRef ks, vs;
  const int64_t *tables, *firsts;
  int64_t table_stride, page_size;
  int64_t first(int64_t b) const { return firsts[b]; }
  const T* key(int64_t b, int64_t g, int64_t j) const { return at(kp, ks, b, g, j); }
  const T* value(int64_t b, int64_t g, int64_t j) const { return at(vp, vs, b, g, j); }
  const T* at(const T* base, at::IntArrayRef st, int64_t b, int64_t g, int64_t j) const {
    const int64_t t = j - firsts[b];
    return base + tables[b * table_stride + t / page_size] * st[0] + g * st[1] + (t % page_size) * st[2];
  }
};

// One (batch row, key/value head) per task: its H/G query heads times L queries are the rows
// r = hh * L + i, all scored against each key as it is read.
template <typename T, typename Keys>
void attend(const at::Tensor& q, const Keys& keys, int64_t G, int64_t S, int64_t Dv,
            const at::Tensor& mask, float scale, bool causal, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t per = H / G, R = per * L;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();  // B x L x H x Dv
  const auto qs = q.strides();
  const bool has_mask = mask.defined(), bool_mask = has_mask && mask.scalar_type() == at::kBool;
  const bool* mb = bool_mask ? mask.data_ptr<bool>() : nullptr;
  const float* mf = has_mask && !bool_mask ? mask.data_ptr<float>() : nullptr;
  const std::vector<int64_t> ms = has_mask ? mask.strides().vec() : std::vector<int64_t>(4, 0);
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(R * D), kf(D), vf(Dv), scores(R * S), acc(R * Dv), total(R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / G, g = t % G, lo = keys.first(b);
      for (int64_t r = 0; r < R; ++r) {
        const T* row = qp + b * qs[0] + (g * per + r / L) * qs[1] + (r % L) * qs[2];
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_float(row[d]);
      }
      for (int64_t j = lo; j < S; ++j) {
        const T* key = keys.key(b, g, j);
        for (int64_t d = 0; d < D; ++d) kf[d] = to_float(key[d]);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t h = g * per + r / L, i = r % L;
          float s = kNegInf;
          if (!causal || j <= S - L + i) {
            const float* qr = qf.data() + r * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qr[d] * kf[d];
            s = dot * scale;
            if (has_mask) {
              const int64_t at = b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3];
              if (bool_mask) s = mb[at] ? s : kNegInf;
              else s += mf[at];
            }
          }
          scores[r * S + j] = s;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* row = scores.data() + r * S;
        float top = kNegInf;
        bool nan = false;
        for (int64_t j = lo; j < S; ++j) {
          nan |= row[j] != row[j];
          top = row[j] > top ? row[j] : top;
        }
        // A NaN or +inf score (NaN in, or q k overflowing) leaves no weight to give: a NaN
        // row, as every backend of attnlab.attention gives.
        nan |= top == -kNegInf;
        total[r] = nan ? std::numeric_limits<float>::quiet_NaN() : 0.f;
        if (nan || !(top > kNegInf)) continue;  // nothing to attend to: a zero output
        total[r] = exp_shifted(row, lo, S, top);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = lo; j < S; ++j) {
        const T* value = keys.value(b, g, j);
        for (int64_t d = 0; d < Dv; ++d) vf[d] = to_float(value[d]);
        for (int64_t r = 0; r < R; ++r) {
          const float p = scores[r * S + j];
          if (!(total[r] > 0.f) || p == 0.f) continue;  // empty or NaN rows: set below
          float* a = acc.data() + r * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) a[d] += p * vf[d];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = g * per + r / L, i = r % L;
        const float inv = total[r] != total[r] ? total[r] : total[r] > 0.f ? 1.f / total[r] : 0.f;
        T* o = op + ((b * L + i) * H + h) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] = T(acc[r * Dv + d] * inv);
      }
    }
  });
}

// The first index of the maximum of x[begin, end), or of its first NaN (as torch.argmax): the
// maxima of blocks of 64 taken with vector loads, then the first block holding the maximum
// (or a NaN) searched entry by entry.
template <typename T>
std::pair<float, int64_t> chunk_argmax(const T* x, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 64;
  float top = kNegInf;
  int64_t found = begin;  // the first block holding `top`
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t stop = std::min(end, b + kBlock);
    float block = kNegInf;
    int nan = 0;
#pragma omp simd reduction(max : block) reduction(| : nan)
    for (int64_t i = b; i < stop; ++i) {
      const float v = to_float(x[i]);
      block = v > block ? v : block;
      nan |= v != v;
    }
    if (nan) {
      for (int64_t i = b; i < stop; ++i)
        if (to_float(x[i]) != to_float(x[i])) return {std::numeric_limits<float>::quiet_NaN(), i};
    }
    if (block > top) {
      top = block;
      found = b;
    }
  }
  for (int64_t i = found; i < std::min(end, found + kBlock); ++i)
    if (to_float(x[i]) == top) return {top, i};
  return {top, begin};  // every entry -inf
}

template <typename T, typename W>
void rms_rows(const T* x, const W* w, T* y, int64_t E, float eps, bool unit_offset,
              int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const T* row = x + n * E;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t e = 0; e < E; ++e) squares += to_float(row[e]) * to_float(row[e]);
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(E) + eps);
    T* out = y + n * E;
    // As the formula: with a unit offset the float32 product is rounded once; otherwise the
    // normalised x is rounded to x's dtype first, then multiplied by the weight and rounded.
    if (unit_offset)
      for (int64_t e = 0; e < E; ++e) out[e] = T(to_float(row[e]) * inv * (1.f + to_float(w[e])));
    else
      for (int64_t e = 0; e < E; ++e) out[e] = T(to_float(T(to_float(row[e]) * inv)) * to_float(w[e]));
  }
}

// Rows [begin, end) of (b, l, h): out = x * cos + turn(x) * sin on the first R features, each
// product and the sum rounded to T as the written-out formula in T rounds them.
#if defined(__AVX512F__) && defined(__AVX512BW__)
using attnlab_lanes::tail16;
inline __m512 load16f(const float* p, __mmask16 n) { return attnlab_lanes::load16_masked(p, n); }
inline __m512 load16f(const at::BFloat16* p, __mmask16 n) {
  return attnlab_lanes::load16_masked(reinterpret_cast<const uint16_t*>(p), n);
}
using attnlab_lanes::bf16_bits;
inline __m512 rounded(__m512 v, const float*) { return v; }
inline __m512 rounded(__m512 v, const at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}
inline void store16f(float* p, __m512 v, __mmask16 n) { _mm512_mask_storeu_ps(p, n, v); }
inline void store16f(at::BFloat16* p, __m512 v, __mmask16 n) { _mm256_mask_storeu_epi16(p, n, bf16_bits(v)); }

// g / (1 + exp(-a)) for 16 floats: silu with a = g, the tanh GELU with a = 2 sqrt(2/pi) (g +
// 0.044715 g^3), since 0.5 g (1 + tanh(a / 2)) = g / (1 + exp(-a)). exp(-a) past float's
// range is inf, so g = -inf gives NaN as the written-out formulas do.
inline __m512 activated16(__m512 g, int64_t kind) {
  __m512 a = g;
  if (kind == 1) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(0.044715f));
    a = _mm512_mul_ps(_mm512_mul_ps(g, _mm512_set1_ps(1.5957691216057308f)),
                      _mm512_add_ps(cube, _mm512_set1_ps(1.f)));
  }
  const __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), a);
  __m512 e = exp16(minus);
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(minus, _mm512_set1_ps(88.7f), _CMP_GT_OQ),
                         _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  return _mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.f)));
}
#elif defined(__AVX2__) && defined(__FMA__)
// 16 values as two vectors of 8 float32: a bfloat16 load's even and odd elements (a shift
// and a mask, no shuffle: 8 at a time with widening and packing ran at 0.8x PyTorch's two
// passes), float32's two halves; and back, each value rounded to T.
inline void load_two(const float* p, __m256* v) {
  v[0] = _mm256_loadu_ps(p);
  v[1] = _mm256_loadu_ps(p + 8);
}
inline void load_two(const at::BFloat16* p, __m256* v) {
  attnlab_lanes::bf16_halves(reinterpret_cast<const uint16_t*>(p), v);
}
inline void store_two(float* p, const __m256* v) {
  _mm256_storeu_ps(p, v[0]);
  _mm256_storeu_ps(p + 8, v[1]);
}
inline void store_two(at::BFloat16* p, const __m256* v) {
  using attnlab_lanes::bf16_rounded;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_or_si256(_mm256_srli_epi32(bf16_rounded(v[0]), 16), bf16_rounded(v[1])));
}
inline __m256 rounded(__m256 v, const float*) { return v; }
inline __m256 rounded(__m256 v, const at::BFloat16*) {
  return _mm256_castsi256_ps(attnlab_lanes::bf16_rounded(v));
}

// activated16 for 8 floats.
inline __m256 activated8(__m256 g, int64_t kind) {
  __m256 a = g;
  if (kind == 1) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(0.044715f));
    a = _mm256_mul_ps(_mm256_mul_ps(g, _mm256_set1_ps(1.5957691216057308f)),
                      _mm256_add_ps(cube, _mm256_set1_ps(1.f)));
  }
  const __m256 minus = _mm256_sub_ps(_mm256_setzero_ps(), a);
  __m256 e = exp8(minus);
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(minus, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
  return _mm256_div_ps(g, _mm256_add_ps(e, _mm256_set1_ps(1.f)));
}

// activation_span for 16 values.
template <typename T>
inline void activated_sixteen(const T* g, const T* up, T* out, int64_t kind) {
  __m256 y[2], u[2];
  load_two(g, y);
  if (up != nullptr) load_two(up, u);
  for (int h = 0; h < 2; ++h) {
    y[h] = activated8(y[h], kind);
    if (up != nullptr) y[h] = _mm256_mul_ps(rounded(y[h], g), u[h]);
  }
  store_two(out, y);
}
#endif

template <typename T>
void rotary_rows(const at::Tensor& x, const T* cos, const T* sin, int64_t cos_rows, bool interleaved,
                 int64_t R, T* out, int64_t begin, int64_t end) {
  const int64_t L = x.size(1), H = x.size(2), D = x.size(3);
  const auto xs = x.strides();
  const T* xp = x.data_ptr<T>();
  const int64_t half = R / 2;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / (L * H), l = (t / H) % L, h = t % H;
    const T* row = xp + b * xs[0] + l * xs[1] + h * xs[2];
    const int64_t at = ((cos_rows == 1 ? 0 : b) * L + l) * R;
    const T *c = cos + at, *s = sin + at;
    T* o = out + t * D;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // 16 features at a time, the same products and roundings as the loop below.
    if (!interleaved) {
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 n = tail16(half - i);
        const __m512 x1 = load16f(row + i, n), x2 = load16f(row + half + i, n);
        const __m512 minus_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
        store16f(o + i, _mm512_add_ps(rounded(_mm512_mul_ps(x1, load16f(c + i, n)), row),
                                      rounded(_mm512_mul_ps(minus_x2, load16f(s + i, n)), row)), n);
        store16f(o + half + i,
                 _mm512_add_ps(rounded(_mm512_mul_ps(x2, load16f(c + half + i, n)), row),
                               rounded(_mm512_mul_ps(x1, load16f(s + half + i, n)), row)), n);
      }
    } else {
      // turn: lane 2j takes -x[2j + 1], lane 2j + 1 takes x[2j] (R is even, so pairs never
      // straddle two vectors).
      const __m512i even_sign = _mm512_set4_epi32(0, static_cast<int>(0x80000000u), 0,
                                                  static_cast<int>(0x80000000u));
      for (int64_t i = 0; i < R; i += 16) {
        const __mmask16 n = tail16(R - i);
        const __m512 xv = load16f(row + i, n);
        const __m512 turned = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_permute_ps(xv, 0xB1)), even_sign));
        store16f(o + i, _mm512_add_ps(rounded(_mm512_mul_ps(xv, load16f(c + i, n)), row),
                                      rounded(_mm512_mul_ps(turned, load16f(s + i, n)), row)), n);
      }
    }
#else
    for (int64_t i = 0; i < R; ++i) {
      const float turned = interleaved ? (i % 2 ? to_float(row[i - 1]) : -to_float(row[i + 1]))
                                       : (i < half ? -to_float(row[i + half]) : to_float(row[i - half]));
      const float a = to_float(T(to_float(row[i]) * to_float(c[i])));
      const float z = to_float(T(turned * to_float(s[i])));
      o[i] = T(a + z);
    }
#endif
    for (int64_t i = R; i < D; ++i) o[i] = row[i];
  }
}

#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && !(defined(__AVX2__) && defined(__FMA__))
inline float activated1(float g, int64_t kind) {
  const float a = kind == 1 ? 1.5957691216057308f * g * (1.f + 0.044715f * g * g) : g;
  return g / (1.f + std::exp(-a));
}
#endif

// out[i] = act(g[i]), times up[i] (after act is rounded to T) when up is given, i in [b, e).
template <typename T>
void activation_span(const T* g, const T* up, T* out, int64_t kind, int64_t b, int64_t e) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 n = tail16(e - i);
    __m512 y = activated16(load16f(g + i, n), kind);
    if (up != nullptr) y = _mm512_mul_ps(rounded(y, g), load16f(up + i, n));
    store16f(out + i, y, n);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  int64_t i = b;
  for (; i + 16 <= e; i += 16)
    activated_sixteen(g + i, up == nullptr ? nullptr : up + i, out + i, kind);
  if (i < e) {  // the last few through 16-value buffers (AVX2 has no 16-bit masked load)
    T gb[16] = {}, ub[16] = {}, ob[16];
    std::copy(g + i, g + e, gb);
    if (up != nullptr) std::copy(up + i, up + e, ub);
    activated_sixteen(gb, up == nullptr ? nullptr : ub, ob, kind);
    std::copy(ob, ob + (e - i), out + i);
  }
#else
  for (int64_t i = b; i < e; ++i) {
    const float y = activated1(static_cast<float>(g[i]), kind);
    out[i] = up == nullptr ? static_cast<T>(y)
                           : static_cast<T>(static_cast<float>(static_cast<T>(y)) * static_cast<float>(up[i]));
  }
#endif
}

}  // namespace

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  bool interleaved) {
  TORCH_CHECK(x.dim() == 4 && x.is_cpu() && x.stride(3) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: expected a B x L x H x D CPU float32 or bfloat16 tensor, last dim contiguous");
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3);
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && (cos.size(0) == 1 || cos.size(0) == B) &&
                  cos.size(1) == L && cos.size(2) % 2 == 0 && cos.size(2) <= D &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos, sin: expected contiguous (B or 1) x L x R tensors in x's dtype, R even <= D");
  auto out = at::empty({B, L, H, D}, x.options());
  const int64_t R = cos.size(2), rows = cos.size(0);
  auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, B * L * H, std::max<int64_t>(1, 8192 / D), [&](int64_t b, int64_t e) {
      rotary_rows<T>(x, cos.data_ptr<T>(), sin.data_ptr<T>(), rows, interleaved, R, op, b, e);
    });
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<at::BFloat16>());
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: expected a contiguous 2-D CPU float32 or bfloat16 tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "weight: expected ", x.size(1), " contiguous float32 or bfloat16 values");
  auto y = at::empty_like(x);
  const int64_t N = x.size(0), E = x.size(1);
  auto run = [&](const auto* xp, auto* yp) {
    auto with_weight = [&](const auto* wp) {
      at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1)),
                       [&](int64_t b, int64_t e) {
        rms_rows(xp, wp, yp, E, static_cast<float>(eps), unit_offset, b, e);
      });
    };
    if (w.scalar_type() == at::kFloat) with_weight(w.data_ptr<float>());
    else with_weight(w.data_ptr<at::BFloat16>());
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>(), y.data_ptr<float>());
  else run(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  return y;
}

bool has_vector_activation() {
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

at::Tensor activation(const at::Tensor& gate, const std::optional<at::Tensor>& up, int64_t kind) {
  TORCH_CHECK(kind == 0 || kind == 1, "kind: expected 0 (silu) or 1 (tanh GELU), got ", kind);
  TORCH_CHECK(gate.is_contiguous() && gate.is_cpu() &&
                  (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              "gate: expected a contiguous CPU float32 or bfloat16 tensor");
  if (up)
    TORCH_CHECK(up->is_contiguous() && up->sizes() == gate.sizes() &&
                    up->scalar_type() == gate.scalar_type(),
                "up: expected a contiguous tensor of gate's shape and dtype");
  auto out = at::empty_like(gate);
  const int64_t n = gate.numel();
  auto run = [&](const auto* gp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(gp)>>;
    const T* upp = up ? up->data_ptr<T>() : nullptr;
    at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
      activation_span<T>(gp, upp, op, kind, b, e);
    });
  };
  if (gate.scalar_type() == at::kFloat) run(gate.data_ptr<float>(), out.data_ptr<float>());
  else run(gate.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

// The checks both attention entry points share: query B x H x L x D, G kv heads dividing H, S
// keys, values of Dv features, the mask B x H x L x S.
static void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, int64_t G, int64_t S) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "query, key, value: expected B x H x L x D, B x G x S x D, B x G x S x Dv");
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "query, key, value: expected CPU tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "query, key, value: expected one dtype, float32 or bfloat16");
  TORCH_CHECK(k.size(3) == q.size(3) && G > 0 && q.size(1) % G == 0,
              "key, value: expected B x G x S x D and B x G x S x Dv with G dividing H");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "query, key, value: expected a contiguous last dim");
  if (mask.defined())
    TORCH_CHECK(mask.dim() == 4 && mask.size(0) == q.size(0) && mask.size(1) == q.size(1) &&
                    mask.size(2) == q.size(2) && mask.size(3) == S &&
                    (mask.scalar_type() == at::kBool || mask.scalar_type() == at::kFloat),
                "mask: expected a bool or float32 B x H x L x S tensor");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask_or_none, double scale,
                            bool causal) {
  const at::Tensor mask = mask_or_none.value_or(at::Tensor());
  check_attention(q, k, v, mask, k.dim() == 4 ? k.size(1) : 0, k.dim() == 4 ? k.size(2) : 0);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
  const int64_t G = k.size(1), S = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == G && v.size(2) == S,
              "key, value: expected B x G x S x D and B x G x S x Dv with G dividing H");
  if (S == 0) return at::zeros({B, L, H, Dv}, q.options()).transpose(1, 2);  // no key
  auto out = at::empty({B, L, H, Dv}, q.options());
  if (q.scalar_type() == at::kFloat)
    attend<float>(q, DenseKeys<float>{k.data_ptr<float>(), v.data_ptr<float>(), k.strides(),
                                      v.strides()}, G, S, Dv, mask, scale, causal, out);
  else
    attend<at::BFloat16>(q, DenseKeys<at::BFloat16>{k.data_ptr<at::BFloat16>(),
                                                    v.data_ptr<at::BFloat16>(), k.strides(),
                                                    v.strides()},
                         G, S, Dv, mask, scale, causal, out);
  return out.transpose(1, 2);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& tables, const at::Tensor& first, int64_t S,
                           const std::optional<at::Tensor>& mask_or_none, double scale,
                           bool causal) {
  const at::Tensor mask = mask_or_none.value_or(at::Tensor());
  check_attention(q, k, v, mask, k.dim() == 4 ? k.size(1) : 0, S);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
  const int64_t G = k.size(1), P = k.size(2), Dv = v.size(3);
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == G && v.size(2) == P && P > 0,
              "key_pages, value_pages: expected N x G x P x D and N x G x P x Dv");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong &&
                  tables.is_contiguous() && first.dim() == 1 && first.size(0) == B &&
                  first.scalar_type() == at::kLong && first.is_contiguous(),
              "tables, first: expected contiguous int64 B x pages and B tensors");
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t pages = k.size(0), per_row = tables.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(fp[b] >= 0 && fp[b] <= S && (S - fp[b]) <= per_row * P,
                "first: expected 0 <= first[b] <= S with the row's keys in its table");
    for (int64_t p = 0; p < (S - fp[b] + P - 1) / P; ++p)
      TORCH_CHECK(tp[b * per_row + p] >= 0 && tp[b * per_row + p] < pages,
                  "tables: expected page numbers in [0, ", pages, ")");
  }
  if (S == 0) return at::zeros({B, L, H, Dv}, q.options()).transpose(1, 2);  // no key
  auto out = at::empty({B, L, H, Dv}, q.options());
  if (q.scalar_type() == at::kFloat)
    attend<float>(q, PagedKeys<float>{k.data_ptr<float>(), v.data_ptr<float>(), k.strides(),
                                      v.strides(), tp, fp, per_row, P},
                  G, S, Dv, mask, scale, causal, out);
  else
    attend<at::BFloat16>(q, PagedKeys<at::BFloat16>{k.data_ptr<at::BFloat16>(),
                                                    v.data_ptr<at::BFloat16>(), k.strides(),
                                                    v.strides(), tp, fp, per_row, P},
                         G, S, Dv, mask, scale, causal, out);
  return out.transpose(1, 2);
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.is_cpu() && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: expected a contiguous 2-D CPU float32 or bfloat16 tensor with columns");
  constexpr int64_t kChunk = 16384;  // a task's share of a row
  const int64_t N = x.size(0), V = x.size(1), chunks = (V + kChunk - 1) / kChunk;
  std::vector<std::pair<float, int64_t>> found(N * chunks);
  auto run = [&](const auto* p) {
    at::parallel_for(0, N * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t / chunks, c = t % chunks;
        found[t] = chunk_argmax(p + n * V, c * kChunk, std::min(V, (c + 1) * kChunk));
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>());
  else run(x.data_ptr<at::BFloat16>());
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    auto best = found[n * chunks];
    for (int64_t c = 1; c < chunks && best.first == best.first; ++c) {
      const auto& next = found[n * chunks + c];
      if (next.first != next.first || next.first > best.first) best = next;
    }
    index[n] = best.second;
  }
  return out;
}
