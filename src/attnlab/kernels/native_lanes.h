// The 16-lane helpers that attnlab's native kernels share, and the 8-lane ones of a build for a
// CPU with AVX2 but not AVX-512 (included by the .cpp files of attnlab.kernels.native, whose
// build digest covers this file too).
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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace attnlab_lanes {

// The sum of 8 floats.
inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// 16 bfloat16 values (bits) as float32: their 8 even elements in v[0], 8 odd in v[1] (a shift
// and a mask; no zero-extension or shuffle).
inline void bf16_halves(const uint16_t* p, __m256* v) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  v[1] = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// v rounded to bfloat16 as bf16_bits rounds it, kept in float32's bits (the low 16 zero), for
// 8 lanes: a shift keeps the value, and the even and odd elements of 16 bfloat16 values go back
// to their places by a shift and an or (no shuffle).
inline __m256i bf16_rounded(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000),
                            _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

}  // namespace attnlab_lanes
#endif
