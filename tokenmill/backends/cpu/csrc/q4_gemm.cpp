// y = x W^T (+ bias) on Q4_1 weights kept as the GGUF file has them
// (quantization="gguf"; model/quantization.py): blocks of 32 4-bit q (0..15), a
// float16 scale d and a float16 minimum m, standing for d * q + m (GGUF's Q4_0,
// (q - 8) d, is loaded as Q4_1 with m = -8 d: the same values).
//
// Packed layout (formats.pack_q4_1; zero rows pad N to a multiple of 16):
//   packed[g][kb] = 320 bytes (5 cache lines): 16 float16 d (lane j: output
//                   16 g + j), 16 float16 m, then for each 8 inputs (kk = 0..3)
//                   64 bytes, byte 4 j + t of them holding q[16 g + j][32 kb + 8 kk + t]
//                   in its low nibble and q[16 g + j][32 kb + 8 kk + 4 + t] in its high one
//   shape [ceil(N/16), K/32, 320] uint8
// so a group g (16 outputs, all of K) is one stretch read front to back, 0.625
// bytes a weight, and 64 bytes unpack (& 15, >> 4 & 15) into two vpdpbusd
// operands: 4 inputs for each of 16 outputs, unsigned 0..15.
//
// Two ways, by the activations' dtype (as q8_gemm.cpp):
// - bfloat16 x: as llama.cpp's Q4_1 x Q8_1 dot, x is quantized per row and block
//   of 32 to int8 (s = max|x| / 127, xq = round(x / s), s in float32), vpdpbusd
//   sums q * xq exactly in int32, and a block adds (d s) * sum + m * (s sum(xq))
//   to float32 accumulators. It differs from the dequantized reference by x's
//   rounding to int8: |y - ref| <= sum_k |d q_k + m| s_k / 2 (tests hold it).
// - float32 x (and bf16 x without VNNI): w = d * q + m in float32, d * q exact
//   (11 + 4 significant bits) and one rounding for + m: the dequantized weights
//   to the bit (gguf's dequantize and model/quantization.py compute them so), one
//   float32 FMA a k and row, k in order.
// Either way a row's result is the same sequence of operations whatever the
// other rows of the call: the batch does not change a row's bits.
//
//   x [M, K] bf16 or float32, packed as above, n_out = N, bias [N] or empty
//   -> y [M, N] in x's dtype, or float32 with float32_out (the logits)
#include <torch/extension.h>

#include "block_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TOKENMILL_Q4_AVX512 1
#else
#define TOKENMILL_Q4_AVX512 0
#endif
#if TOKENMILL_Q4_AVX512 && defined(__AVX512VNNI__)
#define TOKENMILL_Q4_VNNI 1
#else
#define TOKENMILL_Q4_VNNI 0
#endif

namespace q4 {

constexpr int64_t kBlock = block_gemm::kBlock;
constexpr int64_t kBytes = 64 + kBlock * 16 / 2;  // 16 d, 16 m (float16), 32 x 16 nibbles
constexpr int kMaxGroups = block_gemm::kTaskGroups;
// The VNNI tile asks for each group's bytes this far ahead of its loads (q8_gemm's rule).
constexpr int64_t kPrefetchBytes = 2048;

using Args = block_gemm::BlockArgs<float>;  // xt: s * sum(xq) of the block


inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The weight of output lane j, input 32 kb + k, in a block: d * q + m (scalar code).
inline float weight_at(const uint8_t* blk, int j, int k) {
  const int kk = k / 8, t = k % 8;
  const uint8_t byte = blk[64 + 64 * kk + 4 * j + t % 4];
  const int q = t < 4 ? byte & 15 : byte >> 4;
  const float dq = half_at(blk + 2 * j) * static_cast<float>(q);
  return dq + half_at(blk + 32 + 2 * j);
}

#if TOKENMILL_Q4_AVX512
// The float path: rows m0 .. m0+MT of float32 x times groups g0 .. g0+NB.
template <int MT, int NB>
void tile_float(const Args& a, int64_t m0, int64_t g0) {
  const int64_t kb_count = a.K / kBlock, group_bytes = kb_count * kBytes;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = a.w + (g0 + j) * group_bytes;
  const float* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.x + (m0 + i) * a.K;
  const __m512i nib = _mm512_set1_epi8(0x0f), byte = _mm512_set1_epi32(0xff);
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    __m512 d[NB], m[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = base[j] + kb * kBytes;
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      m[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    }
    const int64_t k0 = kb * kBlock;
    for (int kk = 0; kk < 4; ++kk) {
      __m512i v[NB][2];
      for (int j = 0; j < NB; ++j) {
        const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(base[j] + kb * kBytes + 64 + 64 * kk));
        v[j][0] = _mm512_and_si512(raw, nib);
        v[j][1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
      }
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 4; ++t) {
          __m512 w[NB];
          for (int j = 0; j < NB; ++j) {  // byte t of each lane: q; d * q exact, + m rounded once
            const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v[j][h], 8 * t), byte);
            w[j] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), d[j]), m[j]);
          }
          for (int i = 0; i < MT; ++i) {
            const __m512 xb = _mm512_set1_ps(xr[i][k0 + 8 * kk + 4 * h + t]);
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
          }
        }
      }
    }
  }
  block_gemm::store<float, MT, NB>(a, m0, g0, acc);
}

#if TOKENMILL_Q4_VNNI
// The VNNI path: rows m0 .. m0+MT of quantized x times groups g0 .. g0+NB.
// pf, if not null: the next task's groups (pf_bytes, one contiguous stretch),
// fetched into L2 in address order while this tile runs, a kb_count-th of them
// a block (q8_gemm's next-group prefetch). Prefetches change no bits.
template <int MT, int NB>
void tile_vnni(const Args& a, int64_t m0, int64_t g0, const uint8_t* pf, int64_t pf_bytes) {
  const int64_t kb_count = a.K / kBlock, group_bytes = kb_count * kBytes;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = a.w + (g0 + j) * group_bytes;
  const int8_t* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.xq + (m0 + i) * a.K;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const char* pp = reinterpret_cast<const char*>(pf);  // the next line to fetch
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const char* const pend = pf ? reinterpret_cast<const char*>(pf) + pf_bytes * (kb + 1) / kb_count : nullptr;
    __m512i sum[MT][NB];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NB; ++j) sum[i][j] = _mm512_setzero_si512();
    for (int kk = 0; kk < 4; ++kk) {
      __m512i lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = base[j] + kb * kBytes + 64 + 64 * kk;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);  // (past the end: harmless)
        const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
        lo[j] = _mm512_and_si512(raw, nib);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
      }
      for (int i = 0; i < MT; ++i) {
        int32_t four[2];
        std::memcpy(four, xr[i] + kb * kBlock + 8 * kk, 8);
        const __m512i xlo = _mm512_set1_epi32(four[0]), xhi = _mm512_set1_epi32(four[1]);
        for (int j = 0; j < NB; ++j) {
          sum[i][j] = _mm512_dpbusd_epi32(sum[i][j], lo[j], xlo);
          sum[i][j] = _mm512_dpbusd_epi32(sum[i][j], hi[j], xhi);
        }
      }
      for (int j = 0; j < NB; ++j) {
        if (pp < pend) {
          _mm_prefetch(pp, _MM_HINT_T1);
          pp += 64;
        }
      }
    }
    for (; pp < pend; pp += 64) _mm_prefetch(pp, _MM_HINT_T1);
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = base[j] + kb * kBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
      for (int i = 0; i < MT; ++i) {
        const int64_t xb = (m0 + i) * kb_count + kb;
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.xs[xb]));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][j]), ds, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xt[xb]), acc[i][j]);
      }
    }
  }
  block_gemm::store<float, MT, NB>(a, m0, g0, acc);
}
#endif

template <bool VNNI, int MT>
void rows(const Args& a, int64_t m0, int64_t g0, int nb, const uint8_t* pf, int64_t pf_bytes) {
#if TOKENMILL_Q4_VNNI
  if constexpr (VNNI) {
    if (nb == 3) tile_vnni<MT, 3>(a, m0, g0, pf, pf_bytes);
    else if (nb == 2) tile_vnni<MT, 2>(a, m0, g0, pf, pf_bytes);
    else tile_vnni<MT, 1>(a, m0, g0, pf, pf_bytes);
    return;
  }
#else
  (void)pf;
  (void)pf_bytes;
#endif
  if (nb == 3) tile_float<MT, 3>(a, m0, g0);
  else if (nb == 2) tile_float<MT, 2>(a, m0, g0);
  else tile_float<MT, 1>(a, m0, g0);
}
#endif

// Rows [0, M) times groups g0 .. g0+nb (<= kMaxGroups), in row tiles (VNNI 4, float 6).
void task(const Args& a, int64_t M, int64_t g0, int nb, bool vnni) {
#if TOKENMILL_Q4_AVX512
  if (vnni) {
    const int64_t groups = (a.N + 15) / 16, group_bytes = a.K / kBlock * kBytes;
    const int64_t next = std::min<int64_t>(kMaxGroups, groups - (g0 + nb));
    const uint8_t* pf = next > 0 ? a.w + (g0 + nb) * group_bytes : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const uint8_t* p = m0 == 0 ? pf : nullptr;
      const int64_t pb = p ? next * group_bytes : 0;
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: rows<true, 4>(a, m0, g0, nb, p, pb); break;
        case 3: rows<true, 3>(a, m0, g0, nb, p, pb); break;
        case 2: rows<true, 2>(a, m0, g0, nb, p, pb); break;
        default: rows<true, 1>(a, m0, g0, nb, p, pb); break;
      }
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 6) {
    switch (std::min<int64_t>(6, M - m0)) {
      case 6: rows<false, 6>(a, m0, g0, nb, nullptr, 0); break;
      case 5: rows<false, 5>(a, m0, g0, nb, nullptr, 0); break;
      case 4: rows<false, 4>(a, m0, g0, nb, nullptr, 0); break;
      case 3: rows<false, 3>(a, m0, g0, nb, nullptr, 0); break;
      case 2: rows<false, 2>(a, m0, g0, nb, nullptr, 0); break;
      default: rows<false, 1>(a, m0, g0, nb, nullptr, 0); break;
    }
  }
#else  // the float path's sums, one lane at a time
  (void)vnni;
  const int64_t kb_count = a.K / kBlock, group_bytes = kb_count * kBytes;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = g0; g < g0 + nb; ++g)
      for (int l = 0; l < 16 && g * 16 + l < a.N; ++l) {
        float acc = 0.f;
        for (int64_t kb = 0; kb < kb_count; ++kb)
          for (int k = 0; k < kBlock; ++k)
            acc = std::fma(a.x[m * a.K + kb * kBlock + k], weight_at(a.w + g * group_bytes + kb * kBytes, l, k), acc);
        block_gemm::store_one(a, m, g * 16 + l, acc);
      }
#endif
}

}  // namespace q4

// Q4_1's row of block_gemm.h's driver.
struct Q4_1Format {
  static constexpr const char* kName = "Q4_1";
  static constexpr bool kVnni = TOKENMILL_Q4_VNNI;
  using Term = float;  // s * sum(xq), for the blocks' m terms (llama.cpp's Q8_1 keeps the same product)
  static Term term(float s, int32_t total) { return s * static_cast<float>(total); }
  static int64_t group_bytes(int64_t K) { return K / q4::kBlock * q4::kBytes; }
  // This thread's tasks [t0, t1), each fetching the next one into L2 as it runs (int8 path).
  static void tasks(const q4::Args& a, int64_t M, int64_t t0, int64_t t1, int64_t groups, bool vnni) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * q4::kMaxGroups;
      q4::task(a, M, g0, static_cast<int>(std::min<int64_t>(q4::kMaxGroups, groups - g0)), vnni);
    }
  }
};

at::Tensor q4_1_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams&,
                     const GemmSide* side) {
  return block_gemm::gemm<Q4_1Format>(std::move(x), w, float32_out, side);
}
at::Tensor q4_1_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams&) {
  return block_gemm::gemm_silu<Q4_1Format>(std::move(x), w);
}
