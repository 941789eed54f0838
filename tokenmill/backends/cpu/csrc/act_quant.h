// bf16 activations quantized per block of 32 to int8, as llama.cpp's quantize_row_q8_0
// (s = max|x| / 127, xq = x * (1 / s) rounded to the nearest integer, ties to even as its
// AVX code; the scale kept in float32). Shared by q8_gemm.cpp and q4_gemm.cpp: each keeps
// its own per-block term of sum(xq), which `block(kb, s, total)` receives.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TOKENMILL_ACT_QUANT_AVX512 1
#else
#define TOKENMILL_ACT_QUANT_AVX512 0
#endif

namespace act_quant {

constexpr int64_t kBlock = 32;

template <typename Block>
inline void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, Block&& block) {
  for (int64_t kb = 0; kb < K / kBlock; ++kb) {
#if TOKENMILL_ACT_QUANT_AVX512
    const __m256i* src = reinterpret_cast<const __m256i*>(x + kb * kBlock);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src + 1)), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));  // (nearest, ties even)
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + kb * kBlock), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + kb * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
    float v[kBlock], amax = 0.f;
    for (int k = 0; k < kBlock; ++k) {
      const uint32_t u = static_cast<uint32_t>(x[kb * kBlock + k]) << 16;
      std::memcpy(&v[k], &u, 4);
      amax = std::max(amax, std::fabs(v[k]));
    }
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    int32_t total = 0;
    for (int k = 0; k < kBlock; ++k) {
      const int8_t q = static_cast<int8_t>(std::nearbyint(v[k] * inv));  // |v * inv| <= 127: no overflow
      xq[kb * kBlock + k] = q;
      total += q;
    }
#endif
    block(kb, s, total);
  }
}

}  // namespace act_quant
