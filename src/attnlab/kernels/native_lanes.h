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

}  // namespace attnlab_lanes
#endif
