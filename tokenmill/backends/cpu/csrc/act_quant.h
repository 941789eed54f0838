// bf16 activations quantized per block of B (32: llama.cpp's quantize_row_q8_0; 256: its
// Q8_K super-block for the k-quants) to int8: s = max|x| / 127 over the block, xq = x * (1 / s)
// rounded to the nearest integer (ties to even, as its AVX code), the scale kept in float32.
// Shared by q8_gemm.cpp, q4_gemm.cpp and kq_gemm.cpp: each keeps its own per-block terms of
// sum(xq); `block(kb, s, total)` receives the block's scale and sum, and may read the block's
// xq (already written) for finer sums.
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

template <int64_t B = kBlock, typename Block>
inline void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, Block&& block) {
  static_assert(B % 32 == 0, "blocks of whole 32s");
  for (int64_t kb = 0; kb < K / B; ++kb) {
    const uint16_t* xb = x + kb * B;
    int8_t* qb = xq + kb * B;
#if TOKENMILL_ACT_QUANT_AVX512
    auto widen = [&](int64_t k) {  // 16 bf16 at xb + k as float32
      const __m256i* src = reinterpret_cast<const __m256i*>(xb + k);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src)), 16));
    };
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < B; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(widen(k)));
    const float amax = _mm512_reduce_max_ps(mx);
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < B; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen(k), _mm512_set1_ps(inv)));  // (nearest, ties even)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + k), _mm512_cvtepi32_epi8(q));
      sum = _mm512_add_epi32(sum, q);
    }
    const int32_t total = _mm512_reduce_add_epi32(sum);
#else
    float v[B], amax = 0.f;
    for (int64_t k = 0; k < B; ++k) {
      const uint32_t u = static_cast<uint32_t>(xb[k]) << 16;
      std::memcpy(&v[k], &u, 4);
      amax = std::max(amax, std::fabs(v[k]));
    }
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    int32_t total = 0;
    for (int64_t k = 0; k < B; ++k) {
      const int8_t q = static_cast<int8_t>(std::nearbyint(v[k] * inv));  // |v * inv| <= 127: no overflow
      qb[k] = q;
      total += q;
    }
#endif
    block(kb, s, total);
  }
}

}  // namespace act_quant
