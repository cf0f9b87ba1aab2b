// attnlab's native matrix-vector kernels: y = x W^T for a few rows x (decoding), reading each
// weight once, converted to float32 in registers and accumulated in float32.
//
//   gemv       W float32 or bfloat16 (O x K), x the same dtype (M x K)
//   gemv_int8  W' = q * s          q int8 (O x K), s per row (O)
//   gemv_int4  W' = (q - 8) s + z  q 4-bit codes, two a byte, low nibble first (O x K/2),
//                                  s and z per row and group of g inputs (O x K/g)
//
// Every function returns float32 (M x O); the caller rounds to its dtype and adds a bias.
// Threads split the output rows through ATen's parallel_for (torch's own thread pool).
// Written plainly so that the compiler vectorises it for the machine it is built on
// (-O3 -march=native); `omp simd` lets it reorder the float sums, which is what makes a
// vector reduction possible (the result differs from a sequential sum only by rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ATTNLAB_AVX512 1
#endif

namespace {

inline float from_bf16(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

inline float load(float v) { return v; }
inline float load(uint16_t v) { return from_bf16(v); }
inline float load(int8_t v) { return static_cast<float>(v); }

constexpr int64_t kGrain = 64;  // output rows per task, at least

// x as float32 (M x K), converted once for all threads.
std::vector<float> as_float(const torch::Tensor& x) {
  auto f = x.to(torch::kFloat32).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

#ifdef ATTNLAB_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// y[m, o] = row_scale(o) * sum_k W[o, k] x[m, k], m < MB, o in [begin, end): each weight row
// is read once and converted once for all MB rows of x; two accumulators per row of x keep
// two FMA chains in flight.
template <int MB, typename W, typename Scale>
void rows_times_x_block(const W* w, const float* x, float* y, int64_t O, int64_t K,
                        int64_t begin, int64_t end, Scale row_scale) {
  for (int64_t o = begin; o < end; ++o) {
    const W* row = w + o * K;
    __m512 acc[MB], acc2[MB];
    for (int m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512 a = load16(row + k), b = load16(row + k + 16);
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + m * K + k), acc[m]);
        acc2[m] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + m * K + k + 16), acc2[m]);
      }
    }
    for (; k + 16 <= K; k += 16) {
      const __m512 a = load16(row + k);
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
    const float scale = row_scale(o);
    for (int m = 0; m < MB; ++m) {
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
      for (int64_t t = k; t < K; ++t) sum += load(row[t]) * x[m * K + t];
      y[m * O + o] = sum * scale;
    }
  }
}

template <typename W, typename Scale>
void rows_times_x(const W* w, const float* x, float* y, int64_t M, int64_t O, int64_t K,
                  int64_t begin, int64_t end, Scale row_scale) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * O;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: rows_times_x_block<1>(w, xm, ym, O, K, begin, end, row_scale); break;
      case 2: rows_times_x_block<2>(w, xm, ym, O, K, begin, end, row_scale); break;
      case 3: rows_times_x_block<3>(w, xm, ym, O, K, begin, end, row_scale); break;
      case 4: rows_times_x_block<4>(w, xm, ym, O, K, begin, end, row_scale); break;
      case 5: rows_times_x_block<5>(w, xm, ym, O, K, begin, end, row_scale); break;
      case 6: rows_times_x_block<6>(w, xm, ym, O, K, begin, end, row_scale); break;
      case 7: rows_times_x_block<7>(w, xm, ym, O, K, begin, end, row_scale); break;
      default: rows_times_x_block<8>(w, xm, ym, O, K, begin, end, row_scale); break;
    }
  }
}
#else
template <typename W>
inline float dot1(const W* w, int64_t K, const float* x) {
  float a = 0.f;
#pragma omp simd reduction(+ : a)
  for (int64_t k = 0; k < K; ++k) a += load(w[k]) * x[k];
  return a;
}

// y[m, o] = row_scale(o) * sum_k W[o, k] x[m, k] for o in [begin, end).
template <typename W, typename Scale>
void rows_times_x(const W* w, const float* x, float* y, int64_t M, int64_t O, int64_t K,
                  int64_t begin, int64_t end, Scale row_scale) {
  for (int64_t o = begin; o < end; ++o)
    for (int64_t m = 0; m < M; ++m) y[m * O + o] = dot1(w + o * K, K, x + m * K) * row_scale(o);
}
#endif

void check_rows(const torch::Tensor& x, const torch::Tensor& w, int64_t k_stored) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.is_cpu(), "x: expected a contiguous 2-D CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.is_cpu(), "weight: expected a contiguous 2-D CPU tensor");
  TORCH_CHECK(w.size(1) == k_stored, "weight: expected ", k_stored, " stored columns, got ", w.size(1));
}

template <typename S>
const S* scale_ptr(const torch::Tensor& s) { return reinterpret_cast<const S*>(s.data_ptr()); }

}  // namespace

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w) {
  check_rows(x, w, x.size(1));
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight: expected x's dtype");
  const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
  auto y = torch::empty({M, O}, x.options().dtype(torch::kFloat32));
  const auto xf = as_float(x);
  float* out = y.data_ptr<float>();
  auto one = [](int64_t) { return 1.f; };
  if (w.scalar_type() == torch::kFloat32) {
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      rows_times_x(wp, xf.data(), out, M, O, K, b, e, one);
    });
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "weight: expected float32 or bfloat16");
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      rows_times_x(wp, xf.data(), out, M, O, K, b, e, one);
    });
  }
  return y;
}

torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s) {
  check_rows(x, q, x.size(1));
  TORCH_CHECK(q.scalar_type() == torch::kChar, "q: expected int8");
  const int64_t M = x.size(0), K = x.size(1), O = q.size(0);
  TORCH_CHECK(s.is_contiguous() && s.numel() == O, "scales: expected ", O, " values");
  auto y = torch::empty({M, O}, x.options().dtype(torch::kFloat32));
  const auto xf = as_float(x);
  float* out = y.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  auto run = [&](auto row_scale) {
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      rows_times_x(qp, xf.data(), out, M, O, K, b, e, row_scale);
    });
  };
  if (s.scalar_type() == torch::kFloat32) {
    const float* sp = scale_ptr<float>(s);
    run([sp](int64_t o) { return sp[o]; });
  } else {
    TORCH_CHECK(s.scalar_type() == torch::kBFloat16, "scales: expected float32 or bfloat16");
    const uint16_t* sp = scale_ptr<uint16_t>(s);
    run([sp](int64_t o) { return from_bf16(sp[o]); });
  }
  return y;
}

namespace {

// y[m, o] for o in [begin, end): per group j, s_j (q . x - 8 sum x) + z_j sum x, with the
// codes of a byte multiplied by the even (low nibble) and odd (high nibble) inputs.
#ifdef ATTNLAB_AVX512
template <int MB, typename S>
void int4_block(const uint8_t* q, const S* s, const S* z, const float* xe, const float* xo,
                const float* xsum, float* y, int64_t O, int64_t K, int64_t g,
                int64_t begin, int64_t end) {
  const int64_t groups = K / g, half = g / 2, stride = K / 2;
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * stride;
    __m512 acc[MB];
    float shift[MB];
    for (int m = 0; m < MB; ++m) { acc[m] = _mm512_setzero_ps(); shift[m] = 0.f; }
    for (int64_t j = 0; j < groups; ++j) {
      __m512 dlo[MB], dhi[MB];
      for (int m = 0; m < MB; ++m) dlo[m] = dhi[m] = _mm512_setzero_ps();
      for (int64_t i = j * half; i < (j + 1) * half; i += 16) {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(codes, low));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4));
        for (int m = 0; m < MB; ++m) {
          dlo[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe + m * stride + i), dlo[m]);
          dhi[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo + m * stride + i), dhi[m]);
        }
      }
      const float sj = load(s[o * groups + j]), zj = load(z[o * groups + j]);
      const __m512 scale = _mm512_set1_ps(sj);
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm512_fmadd_ps(scale, _mm512_add_ps(dlo[m], dhi[m]), acc[m]);
        shift[m] += (zj - 8.f * sj) * xsum[m * groups + j];
      }
    }
    for (int m = 0; m < MB; ++m) y[m * O + o] = _mm512_reduce_add_ps(acc[m]) + shift[m];
  }
}

template <typename S>
void int4_rows(const uint8_t* q, const S* s, const S* z, const float* xe, const float* xo,
               const float* xsum, float* y, int64_t M, int64_t O, int64_t K, int64_t g,
               int64_t begin, int64_t end) {
  const int64_t stride = K / 2, groups = K / g;
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float *e = xe + m0 * stride, *d = xo + m0 * stride, *t = xsum + m0 * groups;
    float* ym = y + m0 * O;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: int4_block<1>(q, s, z, e, d, t, ym, O, K, g, begin, end); break;
      case 2: int4_block<2>(q, s, z, e, d, t, ym, O, K, g, begin, end); break;
      case 3: int4_block<3>(q, s, z, e, d, t, ym, O, K, g, begin, end); break;
      default: int4_block<4>(q, s, z, e, d, t, ym, O, K, g, begin, end); break;
    }
  }
}
#else
template <typename S>
void int4_rows(const uint8_t* q, const S* s, const S* z, const float* xe, const float* xo,
               const float* xsum, float* y, int64_t M, int64_t O, int64_t K, int64_t g,
               int64_t begin, int64_t end) {
  const int64_t groups = K / g, half = g / 2;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * (K / 2);
    for (int64_t m = 0; m < M; ++m) {
      const float* e = xe + m * (K / 2);
      const float* d = xo + m * (K / 2);
      float acc = 0.f;
      for (int64_t j = 0; j < groups; ++j) {
        const uint8_t* bytes = row + j * half;
        const float* ej = e + j * half;
        const float* dj = d + j * half;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < half; ++i) {
          dot += static_cast<float>(bytes[i] & 15) * ej[i] + static_cast<float>(bytes[i] >> 4) * dj[i];
        }
        const float sum = xsum[m * groups + j];
        acc += load(s[o * groups + j]) * (dot - 8.f * sum) + load(z[o * groups + j]) * sum;
      }
      y[m * O + o] = acc;
    }
  }
}
#endif

}  // namespace

torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& z, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "group_size: expected a multiple of 32 dividing x's ", K, " columns, got ",
              group_size);
  check_rows(x, q, K / 2);
  TORCH_CHECK(q.scalar_type() == torch::kByte, "q: expected uint8");
  const int64_t O = q.size(0), groups = K / group_size;
  TORCH_CHECK(s.is_contiguous() && z.is_contiguous() && s.numel() == O * groups &&
                  z.numel() == O * groups && s.scalar_type() == z.scalar_type(),
              "scales, zeros: expected ", O, " x ", groups, " values of one dtype");
  auto y = torch::empty({M, O}, x.options().dtype(torch::kFloat32));
  const auto xf = as_float(x);
  std::vector<float> xe(M * K / 2), xo(M * K / 2), xsum(M * groups, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < K / 2; ++i) {
      xe[m * K / 2 + i] = xf[m * K + 2 * i];
      xo[m * K / 2 + i] = xf[m * K + 2 * i + 1];
    }
    for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group_size] += xf[m * K + k];
  }
  float* out = y.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  auto run = [&](auto* sp, auto* zp) {
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      int4_rows(qp, sp, zp, xe.data(), xo.data(), xsum.data(), out, M, O, K, group_size, b, e);
    });
  };
  if (s.scalar_type() == torch::kFloat32) {
    run(scale_ptr<float>(s), scale_ptr<float>(z));
  } else {
    TORCH_CHECK(s.scalar_type() == torch::kBFloat16, "scales: expected float32 or bfloat16");
    run(scale_ptr<uint16_t>(s), scale_ptr<uint16_t>(z));
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x W^T (float32), W float32 or bfloat16");
  m.def("gemv_int8", &gemv_int8, "y = x (q s)^T (float32), q int8 per-row scales s");
  m.def("gemv_int4", &gemv_int4, "y = x ((q - 8) s + z)^T (float32), 4-bit groups");
}
