// attnlab's native matrix-vector kernels: y = x W^T for a few rows x (decoding), reading each
// weight once, converted to float32 in registers and accumulated in float32.
//
//   gemv       W float32 or bfloat16 (O x K), x the same dtype (M x K)
//   gemv_int8  W' = q * s          q int8 (O x K), s per row (O)
//   gemv_int8_grouped              W' = q s (+ z): q int8 (O x K), s (and z) per row and
//                                  group of g inputs (O x K/g)
//   gemv_int4  W' = (q - 8) s + z  q 4-bit codes, two a byte, low nibble first (O x K/2),
//                                  s and z per row and group of g inputs (O x K/g)
//
// Every function returns x's dtype (M x O), the optional bias added to the float32 sum before
// the one rounding. Threads split the output rows through ATen's parallel_for (torch's own thread pool). Each
// weight row is read once and used for every row of x (in blocks of up to 8 rows).
//
// The inner loops, by what the compiler targets (-march=native):
// - AVX-512: weights widened to float32, fused multiply-adds;
// - AVX2 with FMA (no AVX-512): 8-lane fused multiply-adds, several weight rows at a time;
// - otherwise plain loops that the compiler vectorises (`omp simd` lets it reorder the sums);
// - with AVX512-BF16 also, when asked (`pairs`) and x is bfloat16: bfloat16 weights, and
//   4-bit codes turned into the bfloat16 numbers 128 + q (exact), multiplied by x in pairs
//   into float32 sums (vdpbf16ps). Fewer instructions, longer dependency chains: which of the
//   two is faster depends on the CPU and the row count, so calibration measures both.
// - with AVX512-VNNI also, when asked (`integers`) with a bfloat16 x: x scaled by a power of
//   two per block of inputs (int8: 256, int4: a row) and rounded to 16-bit integers, multiplied
//   with the codes exactly, in pairs, into int32 sums (vpdpwssd); each block's sum (int4: each
//   128 codes') scaled back in float32. Half the instructions of widening the codes to
//   float32 (an int8 GEMV of one row ran out of arithmetic before memory on an Intel Xeon).
// The sums are float32 in every build, in another order than a sequential sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "native_lanes.h"
#define ATTNLAB_AVX512 1
#if defined(__AVX512BF16__)
#define ATTNLAB_AVX512BF16 1
#endif
#if defined(__AVX512VNNI__)
#define ATTNLAB_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "native_lanes.h"
#define ATTNLAB_AVX2 1
#endif

namespace {

#ifdef ATTNLAB_AVX512
using attnlab_lanes::load16_masked;
using attnlab_lanes::tail16;
#endif

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
// How far ahead of its loads a kernel asks for its weights, into L2 (a prefetch is a hint:
// past the end is harmless). Without it an Intel Xeon streamed a bfloat16 matrix at ~80% of
// `sum`'s bandwidth, with it ~115% (1 KiB to 4 KiB ahead alike; into L1 it did less, and a
// non-temporal hint halved it).
constexpr int64_t kAheadBytes = 2048;
// A kernel keeping more than two rows of x spends longer on each weight: asking further ahead
// kept a float32 GEMV of 4-8 rows 8-14% faster on the Xeon (A/B in turns, 2 KiB vs 18-26 KiB).
constexpr int64_t kAheadManyRows = 16384;

// Ask for the `lines` cache lines `distance` bytes past p (locality 2: prefetcht1 on x86).
template <int lines = 1, int64_t distance = kAheadBytes>
inline void ahead(const void* p) {
  for (int i = 0; i < lines; ++i)
    __builtin_prefetch(static_cast<const char*>(p) + distance + 64 * i, 0, 2);
}

// f(std::integral_constant<int, MB>, m0) for the rows [m0, m0 + MB) of x, MB <= MAX: the
// inner loops keep MB sums in registers, so MB is a compile-time constant.
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

template <int MAX, typename F>
void in_row_blocks(int64_t M, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX)
    with_rows<MAX>(std::min<int64_t>(MAX, M - m0), [&](auto mb) { f(mb, m0); });
}

// Bytes of W that every block of rows of x goes through before the next rows of W, when x has
// more than one block: the blocks after the first read them from cache, so W is read from
// memory once, not once a block.
constexpr int64_t kChunkBytes = 256 * 1024;

// in_row_blocks<MAX> over W's rows [begin, end) in chunks of about kChunkBytes (`row_bytes` a
// row of W; a chunk a multiple of `multiple` rows), each chunk under every block of x before
// the next: f(mb, m0, first, last). A chunk starts where a group of `multiple` rows of W in
// one pass would start, so each output is the same sum, in the same order, as in one pass
// (batch invariance and bit equality hold).
template <int MAX, typename F>
void in_chunks(int64_t M, int64_t row_bytes, int64_t multiple, int64_t begin, int64_t end, F&& f) {
  const int64_t chunk =
      M <= MAX ? end - begin
               : std::max<int64_t>(multiple, kChunkBytes / row_bytes / multiple * multiple);
  for (int64_t first = begin; first < end; first += chunk) {
    const int64_t last = std::min(end, first + chunk);
    in_row_blocks<MAX>(M, [&](auto mb, int64_t m0) { f(mb, m0, first, last); });
  }
}

// x as float32 (M x K), converted once for all threads.
std::vector<float> as_float(const torch::Tensor& x) {
  auto f = x.to(torch::kFloat32).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

template <typename T>
const T* ptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

// The float32 sums of the output rows [begin, end) plus the bias, rounded into `out` (x's
// dtype): each task finishes its own rows.
struct Finish {
  const float* sums;
  const torch::Tensor* bias;  // empty when none
  torch::Tensor* out;
  int64_t M, O;

  void operator()(int64_t begin, int64_t end) const {
    const bool has_bias = bias->defined();
    if (out->scalar_type() == torch::kFloat32) {
      float* y = out->data_ptr<float>();
      if (y == sums && !has_bias) return;  // summed in place
      const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t o = begin; o < end; ++o)
          y[m * O + o] = sums[m * O + o] + (b ? b[o] : 0.f);
      return;
    }
    auto* y = out->data_ptr<at::BFloat16>();
    const at::BFloat16* b = has_bias ? bias->data_ptr<at::BFloat16>() : nullptr;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = begin; o < end; ++o)
        y[m * O + o] = at::BFloat16(sums[m * O + o] + (b ? static_cast<float>(b[o]) : 0.f));
  }
};

// The output in x's dtype and, unless that is float32 with no bias (written in place), a
// float32 buffer for the sums.
struct Output {
  torch::Tensor out, sums;

  Output(const torch::Tensor& x, const torch::Tensor& bias, int64_t O) {
    const int64_t M = x.size(0);
    out = torch::empty({M, O}, x.options());
    const bool direct = x.scalar_type() == torch::kFloat32 && !bias.defined();
    sums = direct ? out : torch::empty({M, O}, x.options().dtype(torch::kFloat32));
  }
  float* data() { return sums.data_ptr<float>(); }
  Finish finish(const torch::Tensor& bias) {
    return Finish{sums.data_ptr<float>(), &bias, &out, out.size(0), out.size(1)};
  }
};

void check_bias(const torch::Tensor& bias, const torch::Tensor& x, int64_t O) {
  if (!bias.defined()) return;
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == O && bias.is_contiguous() &&
                  bias.scalar_type() == x.scalar_type(),
              "bias: expected ", O, " contiguous values in x's dtype");
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

// The vector lanes that `row_groups` is written over.
struct Lanes {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static constexpr int kRegisters = 32;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename T>
  static V load(const T* p) { return load16(p); }
  // The vectors that one load of weights gives (see the AVX2 build's).
  template <typename T>
  static constexpr int parts() { return 1; }
  template <typename T>
  static void load_parts(const T* p, V* v) { v[0] = load16(p); }
  // 16 bytes of 4-bit codes as their low and their high nibbles, in float32.
  static void nibbles(const uint8_t* p, V& lo, V& hi) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4));
  }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(ATTNLAB_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
using attnlab_lanes::sum8;

struct Lanes {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr int kRegisters = 16;
  static V zero() { return _mm256_setzero_ps(); }
  template <typename T>
  static V load(const T* p) { return load8(p); }
  // The vectors that one load of weights gives: bfloat16 weights 16 at a time, as their 8 even
  // and 8 odd elements in float32 (a shift and a mask: no zero-extension, which, with the
  // shift, took two of the four instructions per 8 weights), against x stored paired
  // (`paired_x`). With one row of x, 1.05x over widening 8 at a time (micro-benchmark, cold).
  template <typename T>
  static constexpr int parts() { return std::is_same_v<T, uint16_t> ? 2 : 1; }
  template <typename T>
  static void load_parts(const T* p, V* v) {
    if constexpr (std::is_same_v<T, uint16_t>) {
      attnlab_lanes::bf16_halves(p, v);
    } else {
      v[0] = load8(p);
    }
  }
  // 8 bytes of 4-bit codes as their low and their high nibbles, in float32.
  static void nibbles(const uint8_t* p, V& lo, V& hi) {
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(codes, 4));
  }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) { return sum8(v); }
};
#endif

#if defined(ATTNLAB_AVX512) || defined(ATTNLAB_AVX2)
// The sums for R rows of W at a time, R x MB independent FMA chains, each load of x feeding R
// of them. Each output's sum is one chain over the inputs whatever MB and R, so a row of x gets
// the same sums beside any other rows (batch invariance; attnlab.kernels.rule.BATCH_INVARIANT). With three or more rows of x, one row of W at a time spent more on loading x (MB
// loads a vector of weights) than the weights took to stream: on the Xeon a float32 GEMV of
// 8 rows read 17-25 GB/s of the 30 one row reads; R = 3 (MB > 5) or 4 gave 1.1-1.5x (A/B in
// turns, 15 rounds, cold copies). Built for AVX2, the compiler's vectorised loop kept one
// chain: a bfloat16 GEMV of one row read ~16 GB/s of ~25, of eight rows ~5. The R x MB sums
// stay in registers (AVX-512 at most 24 of 32, AVX2 at most 8 of 16).
//
// A load of weights may give P vectors (Lanes::parts); x is then stored to match (paired_x).
// Each part has its own sums while the registers allow (A = P), else they share them. The
// weights are asked for 16 KiB ahead whatever the rows of x: built for x86-64-v3 on the Xeon,
// that read a bfloat16 matrix 1.1-1.25x faster than 2 KiB with one row (micro-benchmark in
// turns, cold copies); AVX-512 builds run this loop from three rows of x, where 16 KiB won too.
// `Ahead` says how far (rows_times_x's one float32 row of x asks 2 KiB ahead).
template <int MB, int R, int64_t Ahead = kAheadManyRows, typename W, typename Scale>
void row_groups(const W* w, const float* x, float* y, int64_t O, int64_t K, int64_t begin,
                int64_t end, Scale row_scale) {
  using V = Lanes::V;
  constexpr int P = Lanes::parts<W>();
  constexpr int A = R * MB * P + R * P + P <= Lanes::kRegisters ? P : 1;
  constexpr int64_t kStep = P * Lanes::kWidth;
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line: one prefetch each
  int64_t o = begin;
  for (; o + R <= end; o += R) {
    const W* rows = w + o * K;
    V acc[R][MB][A];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m)
        for (int a = 0; a < A; ++a) acc[r][m][a] = Lanes::zero();
    int64_t k = 0;
    for (; k + kStep <= K; k += kStep) {
      V wr[R][P];
      for (int r = 0; r < R; ++r) {
        if (k % kLine == 0) ahead<1, Ahead>(rows + r * K + k);
        Lanes::load_parts(rows + r * K + k, wr[r]);
      }
      for (int m = 0; m < MB; ++m)
        for (int p = 0; p < P; ++p) {
          const V xm = Lanes::load(x + m * K + k + p * Lanes::kWidth);
          for (int r = 0; r < R; ++r)
            acc[r][m][p % A] = Lanes::fmadd(wr[r][p], xm, acc[r][m][p % A]);
        }
    }
    for (int r = 0; r < R; ++r) {
      const W* row = rows + r * K;
      const float scale = row_scale(o + r);
      for (int m = 0; m < MB; ++m) {
        V total = acc[r][m][0];
        for (int a = 1; a < A; ++a) total = Lanes::add(total, acc[r][m][a]);
        float sum = Lanes::sum(total);
        for (int64_t t = k; t < K; ++t) sum += load(row[t]) * x[m * K + t];
        y[m * O + o + r] = sum * scale;
      }
    }
  }
  if constexpr (R > 1) {
    if (o < end) row_groups<MB, 1, Ahead>(w, x, y, O, K, o, end, row_scale);
  }
}

// x (M x K) stored as row_groups reads it against weights W: each whole block of P x width
// inputs (P = Lanes::parts<W>() > 1) as its P interleaved parts one after the other (input
// P j + p at p width + j), the inputs past the last whole block in place.
template <typename W>
void paired_x(std::vector<float>& x, int64_t M, int64_t K) {
  constexpr int P = Lanes::parts<W>();
  constexpr int64_t n = P * Lanes::kWidth;
  if constexpr (P > 1) {
    float block[n];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k + n <= K; k += n) {
        float* b = x.data() + m * K + k;
        for (int p = 0; p < P; ++p)
          for (int64_t j = 0; j < Lanes::kWidth; ++j) block[p * Lanes::kWidth + j] = b[P * j + p];
        std::memcpy(b, block, sizeof block);
      }
  }
}

// A multiple of every R that rows_times_x uses, so that chunks keep the groups of one pass.
constexpr int64_t kChunkRows = 12;

// y = row_scale * x W^T for the rows [begin, end) of W; x stored by paired_x<W>: x's rows in
// blocks of at most 8 (their sums stay in registers), W's rows in_chunks of a multiple of
// kChunkRows, so that a chunk starts where a group of R rows of one pass would start.
template <typename W, typename Scale>
void rows_times_x(const W* w, const float* x, float* y, int64_t M, int64_t O, int64_t K,
                  int64_t begin, int64_t end, Scale row_scale) {
  in_chunks<8>(M, K * int64_t(sizeof(W)), kChunkRows, begin, end,
               [&](auto mb, int64_t m0, int64_t first, int64_t last) {
    constexpr int MB = decltype(mb)::value;
    const float* xm = x + m0 * K;
    float* ym = y + m0 * O;
#ifdef ATTNLAB_AVX512
    // One row of x against float32 weights: one row of W at a time, 2 KiB ahead, as one
    // stream. Weights mapped from a safetensors file (from_pretrained keeps float32 ones in
    // place) lie on the page cache's large pages, where four rows at a time, 16 KiB ahead,
    // took 1.1-1.2x as long on the AMD EPYC (Zen 4) for the 29 products of a 1024-wide
    // 4-layer step (benchmarks/scripts/gemv_one_row.py, CPU time, in turns: 9.9-10.5 against
    // 8.5-9.9 ms), and a float32 decode step used 1.18x the CPU time (issue 38's regression).
    // On copies in anonymous 4 KiB pages four rows were faster: 11.7-12.5 against 13.6-16.0
    // ms (the two-chain one-row loop before them: 12.5-16.5 ms).
    if constexpr (MB == 1 && std::is_same_v<W, float>)
      row_groups<1, 1, kAheadBytes>(w, xm, ym, O, K, first, last, row_scale);
    else
      row_groups<MB, (MB <= 2 ? 4 : MB > 5 ? 3 : 4)>(w, xm, ym, O, K, first, last, row_scale);
#else
    // bfloat16 weights: two rows of W at a time with one row of x streamed 1.25x faster than
    // six; their two parts a load (Lanes::load_parts) take twice the registers.
    constexpr int R = sizeof(W) == 2 ? (MB <= 4 ? 2 : 1) : MB == 1 ? 6 : MB == 2 ? 4 : MB <= 4 ? 2 : 1;
    row_groups<MB, R>(w, xm, ym, O, K, first, last, row_scale);
#endif
  });
}
#else
template <typename W>
void paired_x(std::vector<float>&, int64_t, int64_t) {}  // every load is one part here

// y[m, o] = row_scale(o) * sum_k W[o, k] x[m, k] for o in [begin, end).
template <typename W, typename Scale>
void rows_times_x(const W* w, const float* x, float* y, int64_t M, int64_t O, int64_t K,
                  int64_t begin, int64_t end, Scale row_scale) {
  for (int64_t o = begin; o < end; ++o) {
    const W* row = w + o * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t k = 0; k < K; ++k) a += load(row[k]) * xm[k];
      y[m * O + o] = a * row_scale(o);
    }
  }
}
#endif

#ifdef ATTNLAB_AVX512BF16
inline __m512bh as_bf16(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512bh load32_bf16(const uint16_t* p) { return as_bf16(_mm512_loadu_si512(p)); }
inline __m256bh as_bf16(__m256i v) { return reinterpret_cast<__m256bh&>(v); }
inline __m256bh load16_bf16(const uint16_t* p) {
  return as_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// y[m, o] = sum_k W[o, k] x[m, k] with W and x bfloat16: products of pairs summed in float32
// by vdpbf16ps, 32 inputs an instruction, each output in two chains (even and odd blocks of
// 32 inputs) whatever MB and R. R rows of W at a time share each load of x (R = 2 for a
// server's batch, 4 rows of x a block); an odd last row of W goes alone. The sums of one
// output are the same, in the same order, for any MB and R (batch invariance, same bits).
template <int MB, int R = 1>
void bf16_rows(const uint16_t* w, const uint16_t* x, float* y, int64_t O, int64_t K,
               int64_t begin, int64_t end) {
  static_assert(MB * R <= 8, "16 sums in registers at most");
  int64_t o = begin;
  for (; o + R <= end; o += R) {
    const uint16_t* rows[R];
    __m512 acc[R][MB], acc2[R][MB];
    for (int j = 0; j < R; ++j) {
      rows[j] = w + (o + j) * K;
      for (int m = 0; m < MB; ++m) acc[j][m] = acc2[j][m] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m512bh a[R], b[R];
      for (int j = 0; j < R; ++j) {
        ahead<2, (MB * R > 2 ? kAheadManyRows : kAheadBytes)>(rows[j] + k);
        a[j] = load32_bf16(rows[j] + k);
        b[j] = load32_bf16(rows[j] + k + 32);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512bh x0 = load32_bf16(x + m * K + k), x1 = load32_bf16(x + m * K + k + 32);
        for (int j = 0; j < R; ++j) {
          acc[j][m] = _mm512_dpbf16_ps(acc[j][m], a[j], x0);
          acc2[j][m] = _mm512_dpbf16_ps(acc2[j][m], b[j], x1);
        }
      }
    }
    for (; k + 32 <= K; k += 32) {
      __m512bh a[R];
      for (int j = 0; j < R; ++j) a[j] = load32_bf16(rows[j] + k);
      for (int m = 0; m < MB; ++m) {
        const __m512bh x0 = load32_bf16(x + m * K + k);
        for (int j = 0; j < R; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], a[j], x0);
      }
    }
    for (int j = 0; j < R; ++j)
      for (int m = 0; m < MB; ++m) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][m], acc2[j][m]));
        for (int64_t t = k; t < K; ++t) sum += from_bf16(rows[j][t]) * from_bf16(x[m * K + t]);
        y[m * O + o + j] = sum;
      }
  }
  if constexpr (R > 1) {
    if (o < end) bf16_rows<MB>(w, x, y, O, K, o, end);
  }
}
#endif

#ifdef ATTNLAB_VNNI
constexpr int64_t kIntBlock = 256;  // inputs of x per integer scale, for int8 codes

// x (M x K, bfloat16 values as float32, finite) as 16-bit integers: per row m and block b of
// `block` inputs, c = round(x 2^-e) with e = floor(log2 a) - 14, a = max |x| over the block
// (so 2^14 <= a 2^-e < 2^15, and c = 0 where a = 0); x ~ c 2^e. Powers of two scale exactly:
// an input within 2^7 of a (8 significant bits) is held exactly, a smaller one within 2^(e-1),
// below its own bfloat16 rounding of the block's largest. |c| <= 32640 (a's 8 bits).
struct IntegerRows {
  std::vector<int16_t> codes;  // M x blocks * block
  std::vector<float> scales;   // M x blocks: 2^e
  int64_t block, blocks, stride;

  IntegerRows(const float* x, int64_t M, int64_t K, int64_t block_size)
      : block(block_size), blocks((K + block - 1) / block), stride(blocks * block) {
    codes.assign(M * stride, 0);
    scales.assign(M * blocks, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + m * K + b * block;
        const int64_t n = std::min(block, K - b * block);
        __m512 top = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k += 16)
          top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail16(n - k), xb + k)));
        const float a = _mm512_reduce_max_ps(top);
        if (a == 0.f) continue;
        const int e = std::ilogb(a) - 14;
        scales[m * blocks + b] = std::ldexp(1.f, e);
        const __m512 down = _mm512_set1_ps(static_cast<float>(-e));
        int16_t* cb = codes.data() + m * stride + b * block;
        for (int64_t k = 0; k < n; k += 16) {
          const __mmask16 live = tail16(n - k);
          const __m512 scaled = _mm512_scalef_ps(_mm512_maskz_loadu_ps(live, xb + k), down);
          _mm256_mask_storeu_epi16(cb + k, live, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(scaled)));
        }
      }
  }

};

inline __m512i load32_int8_as_int16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// y[m, o] = row_scale(o) * sum_b 2^e[m, b] * sum_(k in b) q[o, k] c[m, k] for the MB rows of
// x from m0, the inner sums exact in int32 (256 products of at most 128 * 32640).
template <int MB, typename Scale>
void int8_integer_rows(const int8_t* q, const IntegerRows& xi, int64_t m0, float* y, int64_t O,
                       int64_t K, int64_t begin, int64_t end, Scale row_scale) {
  const int16_t* c = xi.codes.data() + m0 * xi.stride;
  const float* xs = xi.scales.data() + m0 * xi.blocks;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* row = q + o * K;
    __m512 sum[MB];
    for (int m = 0; m < MB; ++m) sum[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < xi.blocks; ++b) {
      const int64_t k0 = b * xi.block, k1 = std::min(K, k0 + xi.block);
      __m512i acc[MB], acc2[MB];
      for (int m = 0; m < MB; ++m) acc[m] = acc2[m] = _mm512_setzero_si512();
      int64_t k = k0;
      for (; k + 64 <= k1; k += 64) {
        ahead<1, kAheadManyRows>(row + k);
        const __m512i a = load32_int8_as_int16(row + k), a2 = load32_int8_as_int16(row + k + 32);
        for (int m = 0; m < MB; ++m) {
          const int16_t* cm = c + m * xi.stride + k;
          acc[m] = _mm512_dpwssd_epi32(acc[m], a, _mm512_loadu_si512(cm));
          acc2[m] = _mm512_dpwssd_epi32(acc2[m], a2, _mm512_loadu_si512(cm + 32));
        }
      }
      for (; k < k1; k += 32) {  // the codes past K are never read; x's padding is zero
        const int64_t left = k1 - k;
        const __mmask32 live = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1);
        const __m512i a = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(live, row + k));
        for (int m = 0; m < MB; ++m)
          acc[m] = _mm512_dpwssd_epi32(acc[m], a, _mm512_loadu_si512(c + m * xi.stride + k));
      }
      for (int m = 0; m < MB; ++m)
        sum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[m], acc2[m])),
                                 _mm512_set1_ps(xs[m * xi.blocks + b]), sum[m]);
    }
    const float scale = row_scale(o);
    for (int m = 0; m < MB; ++m) y[m * O + o] = _mm512_reduce_add_ps(sum[m]) * scale;
  }
}
#endif

void check_rows(const torch::Tensor& x, const torch::Tensor& w, int64_t k_stored) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.is_cpu(), "x: expected a contiguous 2-D CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.is_cpu(), "weight: expected a contiguous 2-D CPU tensor");
  TORCH_CHECK(w.size(1) == k_stored, "weight: expected ", k_stored, " stored columns, got ", w.size(1));
}

}  // namespace

bool has_pairs() {
#ifdef ATTNLAB_AVX512BF16
  return true;
#else
  return false;
#endif
}

bool has_integers() {
#ifdef ATTNLAB_VNNI
  return true;
#else
  return false;
#endif
}

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias_or_none,
                   bool pairs) {
  const torch::Tensor bias = bias_or_none.value_or(torch::Tensor());
  check_rows(x, w, x.size(1));
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight: expected x's dtype");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "weight: expected float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
  check_bias(bias, x, O);
  TORCH_CHECK(!pairs || (has_pairs() && w.scalar_type() == torch::kBFloat16),
              "pairs: expected bfloat16 and a build with AVX512-BF16");
  Output y(x, bias, O);
  float* out = y.data();
  const Finish finish = y.finish(bias);
#ifdef ATTNLAB_AVX512BF16
  if (pairs) {
    const uint16_t *wp = ptr<uint16_t>(w), *xp = ptr<uint16_t>(x);
    // Up to 8 rows of x (a decoding step of a few sequences) read W once, a row at a time;
    // more (a server's batch) go 4 at a time past two rows of W, each chunk of W from cache.
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      if (M <= 8) {
        in_row_blocks<8>(M, [&](auto mb, int64_t m0) {
          bf16_rows<decltype(mb)::value>(wp, xp + m0 * K, out + m0 * O, O, K, b, e);
        });
      } else {
        in_chunks<4>(M, 2 * K, 2, b, e, [&](auto mb, int64_t m0, int64_t first, int64_t last) {
          bf16_rows<decltype(mb)::value, 2>(wp, xp + m0 * K, out + m0 * O, O, K, first, last);
        });
      }
      finish(b, e);
    });
    return y.out;
  }
#endif
  auto xf = as_float(x);
  auto one = [](int64_t) { return 1.f; };
  auto run = [&](const auto* wp) {
    paired_x<std::remove_cv_t<std::remove_pointer_t<decltype(wp)>>>(xf, M, K);
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      rows_times_x(wp, xf.data(), out, M, O, K, b, e, one);
      finish(b, e);
    });
  };
  if (w.scalar_type() == torch::kFloat32) run(ptr<float>(w));
  else run(ptr<uint16_t>(w));
  return y.out;
}

torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const std::optional<torch::Tensor>& bias_or_none, bool integers) {
  const torch::Tensor bias = bias_or_none.value_or(torch::Tensor());
  check_rows(x, q, x.size(1));
  TORCH_CHECK(q.scalar_type() == torch::kChar, "q: expected int8");
  const int64_t M = x.size(0), K = x.size(1), O = q.size(0);
  TORCH_CHECK(s.is_contiguous() && s.numel() == O, "scales: expected ", O, " values");
  TORCH_CHECK(s.scalar_type() == torch::kFloat32 || s.scalar_type() == torch::kBFloat16,
              "scales: expected float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x: expected float32 or bfloat16");
  TORCH_CHECK(!integers || (has_integers() && x.scalar_type() == torch::kBFloat16),
              "integers: expected a bfloat16 x and a build with AVX512-VNNI");
  check_bias(bias, x, O);
  Output y(x, bias, O);
  const Finish finish = y.finish(bias);
  const auto xf = as_float(x);
  float* out = y.data();
  const int8_t* qp = ptr<int8_t>(q);
#ifdef ATTNLAB_VNNI
  // x with an infinity or NaN has no integer scale: the float32 loop gives the formula's
  // infinities and NaNs.
  std::optional<IntegerRows> xi;
  if (integers && std::all_of(xf.begin(), xf.end(), [](float v) { return std::isfinite(v); }))
    xi.emplace(xf.data(), M, K, kIntBlock);
#endif
  auto run = [&](auto row_scale) {
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
#ifdef ATTNLAB_VNNI
      if (xi) {
        in_chunks<8>(M, K, 1, b, e, [&](auto mb, int64_t m0, int64_t first, int64_t last) {
          int8_integer_rows<decltype(mb)::value>(qp, *xi, m0, out + m0 * O, O, K, first, last,
                                                 row_scale);
        });
        finish(b, e);
        return;
      }
#endif
      rows_times_x(qp, xf.data(), out, M, O, K, b, e, row_scale);
      finish(b, e);
    });
  };
  if (s.scalar_type() == torch::kFloat32) {
    const float* sp = ptr<float>(s);
    run([sp](int64_t o) { return sp[o]; });
  } else {
    const uint16_t* sp = ptr<uint16_t>(s);
    run([sp](int64_t o) { return from_bf16(sp[o]); });
  }
  return y.out;
}

namespace {

// Grouped int8 (GGUF's Q8_0, Q5_*, Q6_K): per row o and group j of g inputs,
//   sum_k W'[o, k] x[k] = s_j sum_k q_k x_k + z_j sum_k x_k
// (z = 0 without offsets). Each group's dot product is summed in float32 and scaled by s_j
// into the output's sum; the z_j terms go into a second float32 sum, added at the end. The
// order of both depends on K and g only, never on the rows of x beside it nor on the threads'
// split of the outputs: the same sums for a row of x whatever the batch (batch invariance).
struct GroupedArgs {
  const int8_t* q;
  const float* x;     // M x K, the block's first row
  const float* xsum;  // M x groups, the block's first row; null without offsets
  float* y;           // the block's first row of M x O
  int64_t O, K, g;
};

#if defined(ATTNLAB_AVX512) || defined(ATTNLAB_AVX2)
// Rows of x a block: their sums in registers, two a row (AVX-512 2 x 8 + 8 dot products of
// 32 registers; AVX2 2 x 4 + 4 of 16).
constexpr int kGroupedBlock = Lanes::kRegisters >= 32 ? 8 : 4;

// The outputs [begin, end) for MB rows of x. Groups alternate between two vector sums (even
// and odd j), so that a scaled group does not wait for the one before it (one chain of
// multiply-adds a group is 4 cycles for 16 weights: slower than memory with one row of x);
// g a multiple of the vector width.
template <int MB, typename S>
void grouped_rows(const GroupedArgs& a, const S* s, const S* z, int64_t begin, int64_t end) {
  using V = Lanes::V;
  constexpr int64_t W = Lanes::kWidth;
  const int64_t groups = a.K / a.g;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* row = a.q + o * a.K;
    V acc[2][MB];
    float shift[MB];
    for (int m = 0; m < MB; ++m) {
      acc[0][m] = acc[1][m] = Lanes::zero();
      shift[m] = 0.f;
    }
    for (int64_t j = 0; j < groups; ++j) {
      V dot[MB];
      for (int m = 0; m < MB; ++m) dot[m] = Lanes::zero();
      for (int64_t k = j * a.g; k < (j + 1) * a.g; k += W) {
        if (k % 64 == 0) ahead<1, kAheadManyRows>(row + k);
        const V w = Lanes::load(row + k);
        for (int m = 0; m < MB; ++m) dot[m] = Lanes::fmadd(w, Lanes::load(a.x + m * a.K + k), dot[m]);
      }
      const V scale = Lanes::set1(load(s[o * groups + j]));
      for (int m = 0; m < MB; ++m) acc[j & 1][m] = Lanes::fmadd(scale, dot[m], acc[j & 1][m]);
      if (z != nullptr) {
        const float zj = load(z[o * groups + j]);
        for (int m = 0; m < MB; ++m) shift[m] += zj * a.xsum[m * groups + j];
      }
    }
    for (int m = 0; m < MB; ++m)
      a.y[m * a.O + o] = Lanes::sum(Lanes::add(acc[0][m], acc[1][m])) + shift[m];
  }
}
#else
constexpr int kGroupedBlock = 4;

template <int MB, typename S>
void grouped_rows(const GroupedArgs& a, const S* s, const S* z, int64_t begin, int64_t end) {
  const int64_t groups = a.K / a.g;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* row = a.q + o * a.K;
    for (int m = 0; m < MB; ++m) {
      const float* xm = a.x + m * a.K;
      float acc = 0.f, shift = 0.f;
      for (int64_t j = 0; j < groups; ++j) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t k = j * a.g; k < (j + 1) * a.g; ++k) dot += static_cast<float>(row[k]) * xm[k];
        acc += load(s[o * groups + j]) * dot;
        if (z != nullptr) shift += load(z[o * groups + j]) * a.xsum[m * groups + j];
      }
      a.y[m * a.O + o] = acc + shift;
    }
  }
}
#endif

}  // namespace

torch::Tensor gemv_int8_grouped(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                                const std::optional<torch::Tensor>& zeros_or_none, int64_t group_size,
                                const std::optional<torch::Tensor>& bias_or_none) {
  const torch::Tensor bias = bias_or_none.value_or(torch::Tensor());
  const torch::Tensor zeros = zeros_or_none.value_or(torch::Tensor());
  check_rows(x, q, x.size(1));
  TORCH_CHECK(q.scalar_type() == torch::kChar, "q: expected int8");
  const int64_t M = x.size(0), K = x.size(1), O = q.size(0);
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0,
              "group_size: expected a multiple of 16 dividing x's ", K, " columns, got ", group_size);
  const int64_t groups = K / group_size;
  TORCH_CHECK(s.is_contiguous() && s.numel() == O * groups &&
                  (s.scalar_type() == torch::kFloat32 || s.scalar_type() == torch::kBFloat16),
              "scales: expected ", O, " x ", groups, " contiguous float32 or bfloat16 values");
  TORCH_CHECK(!zeros.defined() || (zeros.is_contiguous() && zeros.numel() == O * groups &&
                                   zeros.scalar_type() == s.scalar_type()),
              "zeros: expected None or ", O, " x ", groups, " contiguous values in the scales' dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x: expected float32 or bfloat16");
  check_bias(bias, x, O);
  Output y(x, bias, O);
  const Finish finish = y.finish(bias);
  const auto xf = as_float(x);
  std::vector<float> xsum;  // each row's sum over each group, in order: the offsets' factor
  if (zeros.defined()) {
    xsum.assign(M * groups, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group_size] += xf[m * K + k];
  }
  const GroupedArgs args{ptr<int8_t>(q), xf.data(), xsum.empty() ? nullptr : xsum.data(), y.data(),
                         O, K, group_size};
  auto run = [&](const auto* sp, const auto* zp) {
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      in_chunks<kGroupedBlock>(M, K, 1, b, e, [&](auto mb, int64_t m0, int64_t first, int64_t last) {
        GroupedArgs rows = args;
        rows.x += m0 * K;
        if (rows.xsum != nullptr) rows.xsum += m0 * groups;
        rows.y += m0 * O;
        grouped_rows<decltype(mb)::value>(rows, sp, zp, first, last);
      });
      finish(b, e);
    });
  };
  const bool offsets = zeros.defined();
  if (s.scalar_type() == torch::kFloat32)
    run(ptr<float>(s), offsets ? ptr<float>(zeros) : nullptr);
  else
    run(ptr<uint16_t>(s), offsets ? ptr<uint16_t>(zeros) : nullptr);
  return y.out;
}

namespace {

// The 4-bit kernels compute, per row o and group j of g inputs,
//   sum_k W'[o, k] x[k] = s_j (sum_k q_k x_k - c sum_k x_k) + (z_j - (8 - c) s_j) sum_k x_k
// with c = 8 (codes as they are) or c = 136 (codes read as the bfloat16 numbers 128 + q).
struct Int4Args {
  const uint8_t* q;
  const float* xsum;  // M x groups
  float* y;
  int64_t O, K, g;
};

#ifdef ATTNLAB_AVX512

// Per 128 codes of a window of 16 groups, the permute that moves each group's scale to its
// lanes: lanes 0-7 the group of the block's first 64 codes, lanes 8-15 of its last 64.
inline std::vector<int32_t> block_scale_index(int64_t g) {
  std::vector<int32_t> pick(16 * (g / 8));
  for (int64_t i = 0; i < static_cast<int64_t>(pick.size()) / 16; ++i)
    for (int64_t lane = 0; lane < 16; ++lane)
      pick[16 * i + lane] = static_cast<int32_t>((128 * i + (lane < 8 ? 0 : 64)) / g);
  return pick;
}

// The scales of row o's groups [j0, j0 + 16) (lanes past the last group zero), adding
// (z - c s) sum_j x to shift[m] for each row m of x: the 4-bit kernels' shift term.
template <int MB, typename S>
inline __m512 window_scales(const S* s, const S* z, const float* xsum, int64_t o,
                            int64_t groups, int64_t j0, float c, __m512 shift[MB]) {
  const __mmask16 lanes = tail16(groups - j0);
  const __m512 s16 = load16_masked(s + o * groups + j0, lanes);
  const __m512 step = _mm512_fnmadd_ps(_mm512_set1_ps(c), s16, load16_masked(z + o * groups + j0, lanes));
  for (int m = 0; m < MB; ++m)
    shift[m] = _mm512_fmadd_ps(step, _mm512_maskz_loadu_ps(lanes, xsum + m * groups + j0), shift[m]);
  return s16;
}
#endif

// x (M x K, K a multiple of 64) in the order the 4-bit kernels read 128 codes at a time
// (int4x128_as_bf16, int4x128_as_int16): per block of 128 inputs (of 64 for a last one),
// input 4i + t at position t * 32 + i (t * 16 + i).
template <typename T>
std::vector<T> nibble_order(const T* x, int64_t M, int64_t K) {
  std::vector<T> out(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K; b += 128) {
      const int64_t lanes = std::min<int64_t>(128, K - b) / 4;
      for (int64_t t = 0; t < 4; ++t)
        for (int64_t i = 0; i < lanes; ++i) out[m * K + b + t * lanes + i] = x[m * K + b + 4 * i + t];
    }
  return out;
}

#ifdef ATTNLAB_AVX512BF16
// 16 bytes -> 32 bfloat16 numbers 128 + q in input order: byte j's low nibble is input 2j.
inline __m512bh int4_as_bf16(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // low half of each 32-bit lane: low nibble, high half: high nibble; then 0x4300 | q.
  const __m512i both = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
  return as_bf16(_mm512_ternarylogic_epi32(both, _mm512_set1_epi32(0x000F000F),
                                           _mm512_set1_epi32(0x43004300), 0xEA));  // (a & b) | c
}

// 64 bytes (128 codes) -> four vectors of 32 codes as the bfloat16 numbers 128 + q, by masks
// and shifts inside each 16-bit word (no shuffle): code[t] holds nibble t of every word, i.e.
// input 4i + t of the 128 in lane i; x is read in the same order (`nibble_order`).
inline void int4x128_as_bf16(const uint8_t* p, __m512bh code[4]) {
  const __m512i w = _mm512_loadu_si512(p);
  const __m512i low = _mm512_set1_epi16(0x000F), high = _mm512_set1_epi16(0x4300);
  code[0] = as_bf16(_mm512_ternarylogic_epi32(w, low, high, 0xEA));  // (a & b) | c
  code[1] = as_bf16(_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), low, high, 0xEA));
  code[2] = as_bf16(_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), low, high, 0xEA));
  code[3] = as_bf16(_mm512_or_si512(_mm512_srli_epi16(w, 12), high));
}

// The same for 32 bytes (64 codes, a row's last block when K is an odd multiple of 64).
inline void int4x64_as_bf16(const uint8_t* p, __m256bh code[4]) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x4300);
  code[0] = as_bf16(_mm256_ternarylogic_epi32(w, low, high, 0xEA));
  code[1] = as_bf16(_mm256_ternarylogic_epi32(_mm256_srli_epi16(w, 4), low, high, 0xEA));
  code[2] = as_bf16(_mm256_ternarylogic_epi32(_mm256_srli_epi16(w, 8), low, high, 0xEA));
  code[3] = as_bf16(_mm256_or_si256(_mm256_srli_epi16(w, 12), high));
}

// Group sizes that are multiples of 64 read 128 codes at a time (int4x128_as_bf16: a quarter
// of the instructions of int4_as_bf16 a code, none of them a shuffle) with x in `nibble_order`;
// such a block covers groups k / g and (k + 64) / g, in the sums' lanes 0-7 and 8-15.
template <int MB, bool BY64, typename S>
void int4_bf16_rows(const Int4Args& a, const S* s, const S* z, const uint16_t* x,
                    int64_t begin, int64_t end) {
  const int64_t groups = a.K / a.g, stride = a.K / 2;
  const std::vector<int32_t> pick = BY64 ? block_scale_index(a.g) : std::vector<int32_t>();
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = a.q + o * stride;
    __m512 acc[2][MB], shift[MB];
    for (int m = 0; m < MB; ++m) acc[0][m] = acc[1][m] = shift[m] = _mm512_setzero_ps();
    // Groups 16 at a time: their scales and zeros read as vectors, the shift term summed in
    // vectors, each scale then moved to its lanes (a shuffle; a store and reload can stall).
    for (int64_t j0 = 0; j0 < groups; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, groups - j0);
      const __m512 s16 = window_scales<MB>(s, z, a.xsum, o, groups, j0, 136.f, shift);  // z - 136 s
      if constexpr (BY64) {
        const int64_t start = j0 * a.g, stop = (j0 + n) * a.g;
        int64_t k = start;
        for (; k + 128 <= stop; k += 128) {
          __m512bh code[4];
          ahead<1, (MB > 2 ? kAheadManyRows : kAheadBytes)>(row + k / 2);
          int4x128_as_bf16(row + k / 2, code);
          const __m512 sk = _mm512_permutexvar_ps(
              _mm512_loadu_si512(pick.data() + 16 * ((k - start) / 128)), s16);
          for (int m = 0; m < MB; ++m) {
            const uint16_t* xm = x + m * a.K + k;
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), code[0], load32_bf16(xm));
            d = _mm512_dpbf16_ps(d, code[1], load32_bf16(xm + 32));
            d = _mm512_dpbf16_ps(d, code[2], load32_bf16(xm + 64));
            d = _mm512_dpbf16_ps(d, code[3], load32_bf16(xm + 96));
            acc[0][m] = _mm512_fmadd_ps(sk, d, acc[0][m]);
          }
        }
        if (k < stop) {  // the last 64 codes of the row
          __m256bh code[4];
          int4x64_as_bf16(row + k / 2, code);
          const __m512 sk = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>((k - start) / a.g)), s16);
          for (int m = 0; m < MB; ++m) {
            const uint16_t* xm = x + m * a.K + k;
            __m256 d = _mm256_dpbf16_ps(_mm256_setzero_ps(), code[0], load16_bf16(xm));
            __m256 e = _mm256_dpbf16_ps(_mm256_setzero_ps(), code[1], load16_bf16(xm + 16));
            d = _mm256_dpbf16_ps(d, code[2], load16_bf16(xm + 32));
            e = _mm256_dpbf16_ps(e, code[3], load16_bf16(xm + 48));
            acc[0][m] = _mm512_fmadd_ps(sk, _mm512_zextps256_ps512(_mm256_add_ps(d, e)), acc[0][m]);
          }
        }
      } else {
        for (int64_t j = j0; j < j0 + n; ++j) {
          __m512 dot[MB];
          for (int m = 0; m < MB; ++m) dot[m] = _mm512_setzero_ps();
          for (int64_t k = j * a.g; k < (j + 1) * a.g; k += 32) {
            ahead(row + k / 2);
            const __m512bh codes = int4_as_bf16(row + k / 2);
            for (int m = 0; m < MB; ++m) dot[m] = _mm512_dpbf16_ps(dot[m], codes, load32_bf16(x + m * a.K + k));
          }
          const __m512 sj = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(j - j0)), s16);
          for (int m = 0; m < MB; ++m) acc[j & 1][m] = _mm512_fmadd_ps(sj, dot[m], acc[j & 1][m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      a.y[m * a.O + o] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]), shift[m]));
  }
}

#endif

#ifdef ATTNLAB_VNNI
// 64 bytes (128 codes) -> four vectors of 32 codes as 16-bit integers, code[t] word i holding
// input 4i + t of the 128 (nibble t of word i), as int4x128_as_bf16 without the 128.
inline void int4x128_as_int16(const uint8_t* p, __m512i code[4]) {
  const __m512i w = _mm512_loadu_si512(p), low = _mm512_set1_epi16(0x000F);
  code[0] = _mm512_and_si512(w, low);
  code[1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
  code[2] = _mm512_and_si512(_mm512_srli_epi16(w, 8), low);
  code[3] = _mm512_srli_epi16(w, 12);
}

inline void int4x64_as_int16(const uint8_t* p, __m256i code[4]) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low = _mm256_set1_epi16(0x000F);
  code[0] = _mm256_and_si256(w, low);
  code[1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
  code[2] = _mm256_and_si256(_mm256_srli_epi16(w, 8), low);
  code[3] = _mm256_srli_epi16(w, 12);
}

// As int4_bf16_rows with groups of a multiple of 64, x as one row of 16-bit integers c (in
// nibble order, x ~ c unit[m]): per 128 codes, four exact int32 products q c of pairs
// (vpdpwssd, two chains), turned to float32 and scaled by their groups' s; the shift term
// (z - 8 s) sum_j x as there, with a.xsum the sums of the rounded x.
template <int MB, typename S>
void int4_integer_rows(const Int4Args& a, const S* s, const S* z, const int16_t* c,
                       const float* unit, int64_t begin, int64_t end) {
  const int64_t groups = a.K / a.g, stride = a.K / 2;
  const std::vector<int32_t> pick = block_scale_index(a.g);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = a.q + o * stride;
    __m512 acc[MB], shift[MB];
    for (int m = 0; m < MB; ++m) acc[m] = shift[m] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < groups; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, groups - j0);
      const __m512 s16 = window_scales<MB>(s, z, a.xsum, o, groups, j0, 8.f, shift);  // z - 8 s
      const int64_t start = j0 * a.g, stop = (j0 + n) * a.g;
      int64_t k = start;
      for (; k + 128 <= stop; k += 128) {
        __m512i code[4];
        ahead<1, kAheadManyRows>(row + k / 2);
        int4x128_as_int16(row + k / 2, code);
        const __m512 sk = _mm512_permutexvar_ps(
            _mm512_loadu_si512(pick.data() + 16 * ((k - start) / 128)), s16);
        for (int m = 0; m < MB; ++m) {
          const int16_t* cm = c + m * a.K + k;
          __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), code[0], _mm512_loadu_si512(cm));
          __m512i e = _mm512_dpwssd_epi32(_mm512_setzero_si512(), code[2], _mm512_loadu_si512(cm + 64));
          d = _mm512_dpwssd_epi32(d, code[1], _mm512_loadu_si512(cm + 32));
          e = _mm512_dpwssd_epi32(e, code[3], _mm512_loadu_si512(cm + 96));
          acc[m] = _mm512_fmadd_ps(sk, _mm512_cvtepi32_ps(_mm512_add_epi32(d, e)), acc[m]);
        }
      }
      if (k < stop) {  // the last 64 codes of the row
        __m256i code[4];
        int4x64_as_int16(row + k / 2, code);
        const __m512 sk = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>((k - start) / a.g)), s16);
        for (int m = 0; m < MB; ++m) {
          const int16_t* cm = c + m * a.K + k;
          auto load16 = [](const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
          __m256i d = _mm256_dpwssd_epi32(_mm256_setzero_si256(), code[0], load16(cm));
          __m256i e = _mm256_dpwssd_epi32(_mm256_setzero_si256(), code[2], load16(cm + 32));
          d = _mm256_dpwssd_epi32(d, code[1], load16(cm + 16));
          e = _mm256_dpwssd_epi32(e, code[3], load16(cm + 48));
          const __m512 sum = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(_mm256_add_epi32(d, e)));
          acc[m] = _mm512_fmadd_ps(sk, sum, acc[m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      a.y[m * a.O + o] = unit[m] * _mm512_reduce_add_ps(acc[m]) + _mm512_reduce_add_ps(shift[m]);
  }
}
#endif

#if defined(ATTNLAB_AVX512) || defined(ATTNLAB_AVX2)
// x split into its even (xe) and odd (xo) inputs, M x K/2 each, float32. Without AVX-512 this
// is the 4-bit kernel that runs (the pair and integer ones need AVX512-BF16 and VNNI); the
// plain loop below it read ~3.5 GB/s of codes on the Xeon built for x86-64-v3.
template <int MB, typename S>
void int4_widened_rows(const Int4Args& a, const S* s, const S* z, const float* xe,
                       const float* xo, int64_t begin, int64_t end) {
  using V = Lanes::V;
  constexpr int64_t kBytes = Lanes::kWidth;  // bytes of codes a step (twice as many codes)
  const int64_t groups = a.K / a.g, half = a.g / 2, stride = a.K / 2;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = a.q + o * stride;
    V acc[MB];
    float shift[MB];
    for (int m = 0; m < MB; ++m) { acc[m] = Lanes::zero(); shift[m] = 0.f; }
    for (int64_t j = 0; j < groups; ++j) {
      V dlo[MB], dhi[MB];
      for (int m = 0; m < MB; ++m) dlo[m] = dhi[m] = Lanes::zero();
      for (int64_t i = j * half; i < (j + 1) * half; i += kBytes) {
        if (kBytes >= 16 || i % 16 == 0) ahead(row + i);  // one request per 16 bytes
        V lo, hi;
        Lanes::nibbles(row + i, lo, hi);
        for (int m = 0; m < MB; ++m) {
          dlo[m] = Lanes::fmadd(lo, Lanes::load(xe + m * stride + i), dlo[m]);
          dhi[m] = Lanes::fmadd(hi, Lanes::load(xo + m * stride + i), dhi[m]);
        }
      }
      const float sj = load(s[o * groups + j]), zj = load(z[o * groups + j]);
      const V scale = Lanes::set1(sj);
      for (int m = 0; m < MB; ++m) {
        acc[m] = Lanes::fmadd(scale, Lanes::add(dlo[m], dhi[m]), acc[m]);
        shift[m] += (zj - 8.f * sj) * a.xsum[m * groups + j];
      }
    }
    for (int m = 0; m < MB; ++m) a.y[m * a.O + o] = Lanes::sum(acc[m]) + shift[m];
  }
}
#else
template <int MB, typename S>
void int4_widened_rows(const Int4Args& a, const S* s, const S* z, const float* xe,
                       const float* xo, int64_t begin, int64_t end) {
  const int64_t groups = a.K / a.g, half = a.g / 2, stride = a.K / 2;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = a.q + o * stride;
    for (int m = 0; m < MB; ++m) {
      float acc = 0.f;
      for (int64_t j = 0; j < groups; ++j) {
        const uint8_t* bytes = row + j * half;
        const float* e = xe + m * stride + j * half;
        const float* d = xo + m * stride + j * half;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < half; ++i)
          dot += static_cast<float>(bytes[i] & 15) * e[i] + static_cast<float>(bytes[i] >> 4) * d[i];
        const float sum = a.xsum[m * groups + j];
        acc += load(s[o * groups + j]) * (dot - 8.f * sum) + load(z[o * groups + j]) * sum;
      }
      a.y[m * a.O + o] = acc;
    }
  }
}
#endif

}  // namespace

torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& z, int64_t group_size, const std::optional<torch::Tensor>& bias_or_none,
                        bool pairs, bool integers) {
  const torch::Tensor bias = bias_or_none.value_or(torch::Tensor());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "group_size: expected a multiple of 32 dividing x's ", K, " columns, got ",
              group_size);
  check_rows(x, q, K / 2);
  TORCH_CHECK(q.scalar_type() == torch::kByte, "q: expected uint8");
  const int64_t O = q.size(0), groups = K / group_size;
  TORCH_CHECK(s.is_contiguous() && z.is_contiguous() && s.numel() == O * groups &&
                  z.numel() == O * groups && s.scalar_type() == z.scalar_type() &&
                  (s.scalar_type() == torch::kFloat32 || s.scalar_type() == torch::kBFloat16),
              "scales, zeros: expected ", O, " x ", groups, " float32 or bfloat16 values of one dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x: expected float32 or bfloat16");
  TORCH_CHECK(!pairs || (has_pairs() && x.scalar_type() == torch::kBFloat16),
              "pairs: expected bfloat16 x and a build with AVX512-BF16");
  TORCH_CHECK(!integers || (has_integers() && x.scalar_type() == torch::kBFloat16 &&
                            group_size % 64 == 0 && !pairs),
              "integers: expected bfloat16 x, groups of a multiple of 64, not pairs, and a build "
              "with AVX512-VNNI");
  check_bias(bias, x, O);
  Output y(x, bias, O);
  const Finish finish = y.finish(bias);
  const auto xf = as_float(x);
  std::vector<float> xsum(M * groups, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group_size] += xf[m * K + k];
  const Int4Args args{ptr<uint8_t>(q), xsum.data(), y.data(), O, K, group_size};
  auto run = [&](const auto* sp, const auto* zp) {
#ifdef ATTNLAB_VNNI
    // x as one row of integers per row: 4-bit codes lose far more than its 2^-15.
    if (integers && std::all_of(xf.begin(), xf.end(), [](float v) { return std::isfinite(v); })) {
      const IntegerRows xi(xf.data(), M, K, K);
      const std::vector<int16_t> codes = nibble_order(xi.codes.data(), M, K);
      std::vector<float> sums(M * groups);  // the groups' sums of the rounded x
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < groups; ++j) {
          int64_t total = 0;
          for (int64_t k = j * group_size; k < (j + 1) * group_size; ++k) total += xi.codes[m * K + k];
          sums[m * groups + j] = xi.scales[m] * static_cast<float>(total);
        }
      at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
        in_chunks<8>(M, K / 2, 1, b, e, [&](auto mb, int64_t m0, int64_t first, int64_t last) {
          Int4Args rows = args;
          rows.xsum = sums.data() + m0 * groups;
          rows.y += m0 * O;
          int4_integer_rows<decltype(mb)::value>(rows, sp, zp, codes.data() + m0 * K,
                                                 xi.scales.data() + m0, first, last);
        });
        finish(b, e);
      });
      return;
    }
#endif
#ifdef ATTNLAB_AVX512BF16
    if (pairs) {
      const bool by64 = group_size % 64 == 0;
      const std::vector<uint16_t> xs = by64 ? nibble_order(ptr<uint16_t>(x), M, K) : std::vector<uint16_t>();
      const uint16_t* xp = by64 ? xs.data() : ptr<uint16_t>(x);
      at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
        in_chunks<4>(M, K / 2, 1, b, e, [&](auto mb, int64_t m0, int64_t first, int64_t last) {
          Int4Args rows = args;
          rows.xsum += m0 * groups;
          rows.y += m0 * O;
          if (by64) int4_bf16_rows<decltype(mb)::value, true>(rows, sp, zp, xp + m0 * K, first, last);
          else int4_bf16_rows<decltype(mb)::value, false>(rows, sp, zp, xp + m0 * K, first, last);
        });
        finish(b, e);
      });
      return;
    }
#endif
    std::vector<float> xe(M * K / 2), xo(M * K / 2);
    for (int64_t i = 0; i < M * K / 2; ++i) {
      xe[i] = xf[2 * i];
      xo[i] = xf[2 * i + 1];
    }
    at::parallel_for(0, O, kGrain, [&](int64_t b, int64_t e) {
      in_chunks<4>(M, K / 2, 1, b, e, [&](auto mb, int64_t m0, int64_t first, int64_t last) {
        Int4Args rows = args;
        rows.xsum += m0 * groups;
        rows.y += m0 * O;
        int4_widened_rows<decltype(mb)::value>(rows, sp, zp, xe.data() + m0 * K / 2,
                                               xo.data() + m0 * K / 2, first, last);
      });
      finish(b, e);
    });
  };
  if (s.scalar_type() == torch::kFloat32) run(ptr<float>(s), ptr<float>(z));
  else run(ptr<uint16_t>(s), ptr<uint16_t>(z));
  return y.out;
}

namespace {

// Rows [begin, end) of W' written in float32 (F = float) or bfloat16, rounded once.
template <typename F, typename S>
void int4_rows_out(const uint8_t* q, const S* s, const S* z, F* out, int64_t K, int64_t g,
                   int64_t begin, int64_t end) {
  const int64_t groups = K / g;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * (K / 2);
    F* w = out + o * K;
    for (int64_t j = 0; j < groups; ++j) {
      const float sj = load(s[o * groups + j]), zj = load(z[o * groups + j]);
      for (int64_t i = j * g / 2; i < (j + 1) * g / 2; ++i) {
        // One fused multiply-add, as torch's addcmul (the formula) computes it.
        w[2 * i] = F(std::fma(static_cast<float>((row[i] & 15) - 8), sj, zj));
        w[2 * i + 1] = F(std::fma(static_cast<float>((row[i] >> 4) - 8), sj, zj));
      }
    }
  }
}

template <typename F, typename S>
void int8_rows_out(const int8_t* q, const S* s, F* out, int64_t K, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    const float so = load(s[o]);
    for (int64_t k = 0; k < K; ++k) out[o * K + k] = F(static_cast<float>(q[o * K + k]) * so);
  }
}


// f(out pointer) with the output's element type (float or at::BFloat16), and f(scales) alike.
template <typename F>
void with_out_type(torch::Tensor& out, F&& f) {
  if (out.scalar_type() == torch::kFloat32) f(out.data_ptr<float>());
  else f(out.data_ptr<at::BFloat16>());
}

torch::ScalarType out_dtype(bool bfloat16) { return bfloat16 ? torch::kBFloat16 : torch::kFloat32; }

void check_scales(const torch::Tensor& s, int64_t count) {
  TORCH_CHECK(s.is_contiguous() && s.numel() == count &&
                  (s.scalar_type() == torch::kFloat32 || s.scalar_type() == torch::kBFloat16),
              "scales: expected ", count, " contiguous float32 or bfloat16 values");
}

}  // namespace

torch::Tensor dequantize_int4(const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& z,
                              int64_t group_size, bool bfloat16) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.is_cpu() && q.scalar_type() == torch::kByte,
              "q: expected a contiguous 2-D CPU uint8 tensor");
  const int64_t O = q.size(0), K = 2 * q.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0,
              "group_size: expected an even divisor of ", K, ", got ", group_size);
  check_scales(s, O * (K / group_size));
  check_scales(z, O * (K / group_size));
  TORCH_CHECK(s.scalar_type() == z.scalar_type(), "zeros: expected the scales' dtype");
  auto out = torch::empty({O, K}, q.options().dtype(out_dtype(bfloat16)));
  const uint8_t* qp = ptr<uint8_t>(q);
  with_out_type(out, [&](auto* op) {
    auto run = [&](const auto* sp, const auto* zp) {
      at::parallel_for(0, O, 16, [&](int64_t b, int64_t e) {
        int4_rows_out(qp, sp, zp, op, K, group_size, b, e);
      });
    };
    if (s.scalar_type() == torch::kFloat32) run(ptr<float>(s), ptr<float>(z));
    else run(ptr<uint16_t>(s), ptr<uint16_t>(z));
  });
  return out;
}

torch::Tensor dequantize_int8(const torch::Tensor& q, const torch::Tensor& s, bool bfloat16) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.is_cpu() && q.scalar_type() == torch::kChar,
              "q: expected a contiguous 2-D CPU int8 tensor");
  const int64_t O = q.size(0), K = q.size(1);
  check_scales(s, O);
  auto out = torch::empty({O, K}, q.options().dtype(out_dtype(bfloat16)));
  const int8_t* qp = ptr<int8_t>(q);
  with_out_type(out, [&](auto* op) {
    auto run = [&](const auto* sp) {
      at::parallel_for(0, O, 16, [&](int64_t b, int64_t e) { int8_rows_out(qp, sp, op, K, b, e); });
    };
    if (s.scalar_type() == torch::kFloat32) run(ptr<float>(s));
    else run(ptr<uint16_t>(s));
  });
  return out;
}

// The other kernels of a decoding step, in native_decode.cpp.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::optional<torch::Tensor>& mask, double scale, bool causal);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& tables, const torch::Tensor& first, int64_t S,
                              const std::optional<torch::Tensor>& mask, double scale, bool causal);
torch::Tensor argmax_rows(const torch::Tensor& x);
torch::Tensor activation(const torch::Tensor& gate, const std::optional<torch::Tensor>& up, int64_t kind);
bool has_vector_activation();
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool unit_offset);
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                     bool interleaved);
// The AMX-BF16 tile kernel, in native_tiles.cpp.
bool has_tiles();
torch::Tensor gemv_tiles(const torch::Tensor& x, const torch::Tensor& w,
                         const std::optional<torch::Tensor>& bias);
torch::Tensor gemv_int8_tiles(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                              const std::optional<torch::Tensor>& bias);
// A decoding step through every block (StepPlan and its enums), in native_step.cpp.
void bind_step(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_pairs", &has_pairs, "whether this build has the bfloat16 pair-product loops");
  m.def("has_tiles", &has_tiles, "whether this process may run the AMX-BF16 tile kernel");
  m.def("gemv", &gemv, "y = x W^T + b, W float32 or bfloat16");
  m.def("gemv_tiles", &gemv_tiles, "y = x W^T + b, bfloat16, on AMX tiles");
  m.def("gemv_int8_tiles", &gemv_int8_tiles, "y = x (q s)^T + b, q int8, on AMX tiles");
  m.def("gemv_int8", &gemv_int8, "y = x (q s)^T + b, q int8 with per-row scales s");
  m.def("has_integers", &has_integers, "whether this build has the integer-product loops");
  m.def("gemv_int8_grouped", &gemv_int8_grouped,
        "y = x (q s + z)^T + b, q int8 with scales s (and offsets z) per group of inputs");
  m.def("gemv_int4", &gemv_int4, "y = x ((q - 8) s + z)^T + b, 4-bit codes in groups");
  m.def("dequantize_int4", &dequantize_int4, "W' = (q - 8) s + z per group");
  m.def("dequantize_int8", &dequantize_int8, "W' = q s per row");
  m.def("decode_attention", &decode_attention, "softmax(q k^T scale + mask) v for a few queries");
  m.def("paged_attention", &paged_attention, "decode_attention over keys kept in pages");
  m.def("argmax_rows", &argmax_rows, "the first index of each row's maximum");
  m.def("activation", &activation, "silu(g) or tanh GELU(g), times up when given");
  m.def("has_vector_activation", &has_vector_activation, "whether activation has a vector loop (AVX-512, or AVX2 and FMA)");
  m.def("rms_norm", &rms_norm, "x / sqrt(mean(x^2) + eps) * w per row");
  m.def("rotary", &rotary, "x * cos + turn(x) * sin on the first R features of each head");
  bind_step(m);
}
