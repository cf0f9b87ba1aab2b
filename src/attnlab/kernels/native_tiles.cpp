// y = x W^T + b for a few bfloat16 rows x on the CPU's matrix tiles (Intel AMX), reading the
// row-major weight where it lies: no packed copy. W bfloat16, or int8 codes with a scale per
// row (y = (x q^T) s + b), each 32 codes widened to bfloat16 (exact) just before its tile
// product.
//
// A tile product C += A B (TDPBF16PS) takes A 16 x 32 bfloat16, B 16 x 16 pairs of bfloat16
// and C 16 x 16 float32, C[i][j] += sum_p A[i][2p] B[p][j][0] + A[i][2p + 1] B[p][j][1]. With
// A = 16 rows of W (32 inputs each, loaded with the row stride) and B = the same 32 inputs of
// 16 rows of x as pairs (x packed once per call), C[i][j] = (x W^T)[j][i] for those rows:
//
//   for each block of 32 rows of W (two A tiles) and each 32 inputs k:
//     C[a][b] += A_a(W rows, k) B_b(x rows 16b .. 16b + 15, k)     a, b in {0, 1}
//
// so each weight is read once for up to 32 rows of x, and a tile product does 16 x 16 x 32
// multiply-adds: the arithmetic never limits a decoding step, which then runs at the rate the
// weight streams from memory. Sums are float32 (pairs of products added, then into C), rounded
// once to x's dtype with the bias. Rows of W past a multiple of 32 are copied into a
// zero-padded block; inputs past a multiple of 32 are added in a plain loop.
//
// Linux lends a process the tile registers only when asked (arch_prctl); `has_tiles` asks
// once and says whether the CPU, the build (-march=native on a CPU with AMX-BF16) and the
// kernel allow them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "native_lanes.h"
#define ATTNLAB_TILES 1
#endif

namespace {

#ifdef ATTNLAB_TILES
constexpr int64_t kRows = 16;       // rows of a tile
constexpr int64_t kInputs = 32;     // bfloat16 inputs in a tile row (64 bytes)
constexpr int64_t kBlock = 2 * kRows;  // rows of W per step: two A tiles
constexpr int64_t kMaxX = 2 * kRows;   // rows of x per pass: two B tiles

// The tile shapes, palette 1: tiles 0-3 C (16 rows x 64 bytes), 4-5 A, 6-7 B.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = kRows;
    }
  }
};

bool request_tiles() {
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

// x rows [m0, m0 + mb) as B tiles: for inputs 32j .. 32j + 31, tile j is 16 rows p of 16
// pairs (x[m][32j + 2p], x[m][32j + 2p + 1]), rows of x past mb zero; `b` of them (b = 1, 2).
std::vector<uint32_t> pack_x(const uint16_t* x, int64_t K, int64_t m0, int64_t mb, int b) {
  const int64_t steps = K / kInputs;
  std::vector<uint32_t> packed(steps * b * kRows * kRows, 0u);
  for (int64_t j = 0; j < steps; ++j)
    for (int t = 0; t < b; ++t)
      for (int64_t p = 0; p < kRows; ++p)
        for (int64_t i = 0; i < kRows; ++i) {
          const int64_t m = t * kRows + i;
          if (m >= mb) break;
          uint32_t pair;
          std::memcpy(&pair, x + (m0 + m) * K + j * kInputs + 2 * p, sizeof pair);
          packed[((j * b + t) * kRows + p) * kRows + i] = pair;
        }
  return packed;
}

// 32 rows of int8 codes (row stride K), inputs 32j .. 32j + 31, as two A tiles of bfloat16
// in `buffer` (2 x 16 x 32): every int8 is a bfloat16 number exactly.
inline void widen_int8(const int8_t* q, int64_t K, int64_t j, uint16_t* buffer) {
  for (int64_t r = 0; r < kBlock; ++r) {
    const int8_t* p = q + r * K + j * kInputs;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 first
    std::memcpy(buffer + r * kInputs, &both, 64);
  }
}

// C tiles for 32 rows of W starting at `w` (row stride K; bfloat16, or int8 codes widened
// through `buffer`, two of 32 x 32), x as `b` packed B tiles, into sums[i][m] (32 x 32 float32).
template <int B, typename W>
void block_sums(const W* w, int64_t K, const uint32_t* xb, float* sums, uint16_t* buffer) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (B == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int64_t steps = K / kInputs;
  // int8: step j + 1 widened while step j's tiles load (a tile load waits for the stores
  // that wrote its bytes; two buffers give them a step to land)
  if constexpr (std::is_same_v<W, int8_t>) {
    if (steps > 0) widen_int8(w, K, 0, buffer);
  }
  for (int64_t j = 0; j < steps; ++j) {
    if constexpr (std::is_same_v<W, int8_t>) {
      const uint16_t* ready = buffer + (j & 1) * kBlock * kInputs;
      if (j + 1 < steps) widen_int8(w, K, j + 1, buffer + ((j + 1) & 1) * kBlock * kInputs);
      _tile_loadd(4, ready, 64);
      _tile_loadd(5, ready + kRows * kInputs, 64);
    } else {
      const W* a = w + j * kInputs;
      _tile_loadd(4, a, K * 2);
      _tile_loadd(5, a + kRows * K, K * 2);
    }
    _tile_loadd(6, xb + j * B * kRows * kRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (B == 2) {
      _tile_loadd(7, xb + (j * B + 1) * kRows * kRows, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  // sums row i: W row i's products with x rows 0..15 (and 16..31)
  _tile_stored(0, sums, kMaxX * 4);
  _tile_stored(2, sums + kRows * kMaxX, kMaxX * 4);
  if constexpr (B == 2) {
    _tile_stored(1, sums + kRows, kMaxX * 4);
    _tile_stored(3, sums + kRows * kMaxX + kRows, kMaxX * 4);
  }
}

inline float as_float(uint16_t v) { return c10::detail::f32_from_bits(v); }
inline float as_float(int8_t v) { return static_cast<float>(v); }

// y[m, n0 + i] = sums[i][m] * scale(n0 + i) + b[n0 + i] for i < rows, m < mb, rounded to
// bfloat16 as c10 rounds: 16 rows of W a vector, each x row's sums gathered from the tile's
// column. One element at a time this took ~2 ns an output: a tenth of a block's streaming
// time at eight rows of x.
template <typename Scale>
void write_block(const float* sums, Scale scale, const uint16_t* bp, int64_t n0, int64_t rows,
                 int64_t mb, uint16_t* y, int64_t O) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(kMaxX));
  for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
    const __mmask16 n = attnlab_lanes::tail16(rows - i0);
    alignas(64) float factors[kRows], offsets[kRows];
    for (int64_t i = 0; i < kRows; ++i) {
      const bool real = i0 + i < rows;
      factors[i] = real ? scale(n0 + i0 + i) : 0.f;
      offsets[i] = real && bp ? as_float(bp[n0 + i0 + i]) : 0.f;
    }
    const __m512 f = _mm512_load_ps(factors), c = _mm512_load_ps(offsets);
    for (int64_t m = 0; m < mb; ++m) {
      const __m512 v = _mm512_i32gather_ps(column, sums + i0 * kMaxX + m, 4);
      const __m512 scaled = _mm512_mul_ps(v, f);  // no bias, no add: -0 stays -0
      const __m512 out = bp ? _mm512_add_ps(scaled, c) : scaled;
      _mm256_mask_storeu_epi16(y + m * O + n0 + i0, n, attnlab_lanes::bf16_bits(out));
    }
  }
}

// y = (x W^T) * scale(o) + b for x (M x K bfloat16) and W (O x K, bfloat16 or int8 codes):
// the blocks of 32 rows of W split between the threads, x in passes of 32 rows.
template <typename W, typename Scale>
void tiles_product(const torch::Tensor& x, const W* wp, int64_t O, Scale scale,
                   const uint16_t* bp, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t K32 = K - K % kInputs, blocks = (O + kBlock - 1) / kBlock;
  // The last block's rows, zero-padded to 32 (only when O is not a multiple of 32).
  std::vector<W> tail;
  if (O % kBlock) {
    tail.assign(kBlock * K, W(0));
    std::memcpy(tail.data(), wp + (blocks - 1) * kBlock * K, (O % kBlock) * K * sizeof(W));
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxX) {
    const int64_t mb = std::min<int64_t>(kMaxX, M - m0);
    const int b = mb > kRows ? 2 : 1;
    const std::vector<uint32_t> xb = pack_x(xp, K, m0, mb, b);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      static const TileConfig config;
      _tile_loadconfig(&config);
      alignas(64) float sums[kBlock * kMaxX];
      alignas(64) uint16_t buffer[2 * kBlock * kInputs];
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n0 = blk * kBlock, rows = std::min<int64_t>(kBlock, O - n0);
        const W* a = rows < kBlock ? tail.data() : wp + n0 * K;
        if (b == 2) block_sums<2>(a, K, xb.data(), sums, buffer);
        else block_sums<1>(a, K, xb.data(), sums, buffer);
        for (int64_t i = 0; K32 < K && i < rows; ++i) {  // the inputs past the tiles
          const W* row = wp + (n0 + i) * K;
          for (int64_t m = 0; m < mb; ++m)
            for (int64_t k = K32; k < K; ++k)
              sums[i * kMaxX + m] += as_float(row[k]) * as_float(xp[(m0 + m) * K + k]);
        }
        write_block(sums, scale, bp, n0, rows, mb, yp + m0 * O, O);
      }
      _tile_release();
    });
  }
}

#endif

// The tile products' x (checked first, so that a malformed x is named as such) and bias.
void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.is_cpu() && x.scalar_type() == torch::kBFloat16,
              "x: expected a contiguous 2-D bfloat16 CPU tensor");
}

void check_bias(const torch::Tensor& bias, int64_t O) {
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == O && bias.is_contiguous() &&
                                  bias.scalar_type() == torch::kBFloat16),
              "bias: expected ", O, " contiguous bfloat16 values");
}

}  // namespace

bool has_tiles() {
#ifdef ATTNLAB_TILES
  static const bool granted = request_tiles();
  return granted;
#else
  return false;
#endif
}

namespace {

// The checks the tile products share, in this order: tiles, x, the stored weight `w`
// (`what`: its name and kind, `dtype`), bias; returns the output M x O.
torch::Tensor checked_output(const char* kernel, const torch::Tensor& x, const torch::Tensor& w,
                             torch::ScalarType dtype, const char* what, const torch::Tensor& bias) {
  TORCH_CHECK(has_tiles(), kernel, ": this CPU, build or kernel gives no AMX-BF16 tiles");
  check_x(x);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.is_cpu() && w.scalar_type() == dtype &&
                  w.size(1) == x.size(1),
              what, " O x ", x.size(1), " on the CPU");
  check_bias(bias, w.size(0));
  return torch::empty({x.size(0), w.size(0)}, x.options());
}

}  // namespace

torch::Tensor gemv_tiles(const torch::Tensor& x, const torch::Tensor& w,
                         const std::optional<torch::Tensor>& bias_or_none) {
  const torch::Tensor bias = bias_or_none.value_or(torch::Tensor());
  auto out = checked_output("gemv_tiles", x, w, torch::kBFloat16,
                            "weight: expected a contiguous bfloat16", bias);
#ifdef ATTNLAB_TILES
  tiles_product(x, reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(0),
                [](int64_t) { return 1.f; },
                bias.defined() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr, out);
#endif
  return out;
}

torch::Tensor gemv_int8_tiles(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                              const std::optional<torch::Tensor>& bias_or_none) {
  const torch::Tensor bias = bias_or_none.value_or(torch::Tensor());
  auto out = checked_output("gemv_int8_tiles", x, q, torch::kChar,
                            "q: expected contiguous int8 codes", bias);
  const int64_t O = q.size(0);
  TORCH_CHECK(s.is_contiguous() && s.numel() == O &&
                  (s.scalar_type() == torch::kFloat32 || s.scalar_type() == torch::kBFloat16),
              "scales: expected ", O, " float32 or bfloat16 values");
#ifdef ATTNLAB_TILES
  const auto* bp = bias.defined() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr;
  const auto* qp = reinterpret_cast<const int8_t*>(q.data_ptr());
  if (s.scalar_type() == torch::kFloat32) {
    const float* sp = s.data_ptr<float>();
    tiles_product(x, qp, O, [sp](int64_t o) { return sp[o]; }, bp, out);
  } else {
    const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr());
    tiles_product(x, qp, O, [sp](int64_t o) { return as_float(sp[o]); }, bp, out);
  }
#endif
  return out;
}
