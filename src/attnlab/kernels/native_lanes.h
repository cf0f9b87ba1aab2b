// The 16-lane helpers that attnlab's native kernels share (included by the .cpp files of
// attnlab.kernels.native, whose build digest covers this file too).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstdint>

namespace attnlab_lanes {

// The first min(left, 16) lanes.
inline __mmask16 tail16(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// 16 float32 or bfloat16 values from p as float32 (exactly), the lanes outside n zero.
inline __m512 load16_masked(const float* p, __mmask16 n) { return _mm512_maskz_loadu_ps(n, p); }
inline __m512 load16_masked(const uint16_t* p, __mmask16 n) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(n, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// float32 -> bfloat16 bits rounded to nearest even, NaN kept a (quiet) NaN, subnormals kept:
// c10's rounding. Not vcvtneps2bf16, which flushes subnormal inputs to zero (a bfloat16 has
// float32's exponent range, so c10 keeps them).
inline __m256i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

}  // namespace attnlab_lanes
#endif
