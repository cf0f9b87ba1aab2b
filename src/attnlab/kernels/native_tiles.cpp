// y = x W^T + b for a few bfloat16 rows x on the CPU's matrix tiles (Intel AMX), reading the
// row-major weight where it lies: no packed copy.
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
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
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

inline float from_bf16(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
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

// C tiles for 32 rows of W starting at `w` (row stride K), x as `b` packed B tiles, into
// sums[i][m] (32 x 32 float32).
template <int B>
void block_sums(const uint16_t* w, int64_t K, const uint32_t* xb, float* sums) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (B == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int64_t stride = K * 2, steps = K / kInputs;
  for (int64_t j = 0; j < steps; ++j) {
    const uint16_t* a = w + j * kInputs;
    _tile_loadd(4, a, stride);
    _tile_loadd(5, a + kRows * K, stride);
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
#endif

}  // namespace

bool has_tiles() {
#ifdef ATTNLAB_TILES
  static const bool granted = request_tiles();
  return granted;
#else
  return false;
#endif
}

torch::Tensor gemv_tiles(const torch::Tensor& x, const torch::Tensor& w,
                         const std::optional<torch::Tensor>& bias_or_none) {
  TORCH_CHECK(has_tiles(), "gemv_tiles: this CPU, build or kernel gives no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.is_cpu() && x.scalar_type() == torch::kBFloat16,
              "x: expected a contiguous 2-D bfloat16 CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.is_cpu() && w.scalar_type() == torch::kBFloat16 &&
                  w.size(1) == x.size(1),
              "weight: expected a contiguous bfloat16 O x ", x.size(1), " CPU tensor");
  const torch::Tensor bias = bias_or_none.value_or(torch::Tensor());
  const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == O && bias.is_contiguous() &&
                                  bias.scalar_type() == torch::kBFloat16),
              "bias: expected ", O, " contiguous bfloat16 values");
  auto out = torch::empty({M, O}, x.options());
#ifdef ATTNLAB_TILES
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* bp = bias.defined() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t K32 = K - K % kInputs, blocks = (O + kBlock - 1) / kBlock;
  // The last block's rows, zero-padded to 32 (only when O is not a multiple of 32).
  std::vector<uint16_t> tail;
  if (O % kBlock) {
    tail.assign(kBlock * K, 0);
    std::memcpy(tail.data(), wp + (blocks - 1) * kBlock * K, (O % kBlock) * K * sizeof(uint16_t));
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxX) {
    const int64_t mb = std::min<int64_t>(kMaxX, M - m0);
    const int b = mb > kRows ? 2 : 1;
    const std::vector<uint32_t> xb = pack_x(xp, K, m0, mb, b);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      static const TileConfig config;
      _tile_loadconfig(&config);
      alignas(64) float sums[kBlock * kMaxX];
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n0 = blk * kBlock, rows = std::min<int64_t>(kBlock, O - n0);
        const uint16_t* a = rows < kBlock ? tail.data() : wp + n0 * K;
        if (b == 2) block_sums<2>(a, K, xb.data(), sums);
        else block_sums<1>(a, K, xb.data(), sums);
        for (int64_t i = 0; i < rows; ++i) {
          const uint16_t* row = wp + (n0 + i) * K;
          for (int64_t m = 0; m < mb; ++m) {
            float s = sums[i * kMaxX + m];
            for (int64_t k = K32; k < K; ++k) s += from_bf16(row[k]) * from_bf16(xp[(m0 + m) * K + k]);
            if (bp) s += from_bf16(bp[n0 + i]);
            const at::BFloat16 rounded(s);
            std::memcpy(yp + (m0 + m) * O + n0 + i, &rounded, sizeof(uint16_t));
          }
        }
      }
      _tile_release();
    });
  }
#endif
  return out;
}
