// y = x W^T (+ bias) on Q4_1 weights kept as the GGUF file has them
// (quantization="gguf"; model/quantization.py): blocks of 32 4-bit q (0..15), a
// float16 scale d and a float16 minimum m, standing for d * q + m (GGUF's Q4_0,
// (q - 8) d, is loaded as Q4_1 with m = -8 d: the same values).
//
// Packed layout (memory.pack_q4_1; zero rows pad N to a multiple of 16):
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

#include "act_quant.h"
#include "no_gil.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

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

at::Tensor silu_and_mul(at::Tensor gate_up);

namespace q4 {

constexpr int64_t kBlock = 32;
constexpr int64_t kBytes = 64 + kBlock * 16 / 2;  // 16 d, 16 m (float16), 32 x 16 nibbles
constexpr int kMaxGroups = 3;
// The VNNI tile asks for each group's bytes this far ahead of its loads (q8_gemm's rule).
constexpr int64_t kPrefetchBytes = 2048;

struct Args {
  const float* x;      // [M, K] float32 (the float path)
  const int8_t* xq;    // [M, K] x quantized (the VNNI path)
  const float* xs;     // [M, K/32] its scales
  const float* xsum;   // [M, K/32] s * sum(xq) of the block
  const uint8_t* w;    // packed
  const float* bias;   // [G * 16] float32, or null
  uint16_t* y16;       // [M, N] bf16 out, or null
  float* y32;          // [M, N] float32 out, or null
  int64_t K, N;
};

inline uint16_t bf16_round(float f) {  // nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

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
template <int MT, int NB>
inline void store(const Args& a, int64_t m0, int64_t g0, __m512 (&acc)[MT][NB]) {
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (g0 + j) * 16;
    const __mmask16 mask = a.N - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.N - n0)) - 1);
    const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MT; ++i) {
      const __m512 r = _mm512_add_ps(acc[i][j], bias);  // + 0 leaves the sum as it is
      if (a.y32) {
        _mm512_mask_storeu_ps(a.y32 + (m0 + i) * a.N + n0, mask, r);
        continue;
      }
#if defined(__AVX512BF16__)
      _mm256_mask_storeu_epi16(a.y16 + (m0 + i) * a.N + n0, mask, (__m256i)_mm512_cvtneps_pbh(r));
#else
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, r);
      uint16_t* out = a.y16 + (m0 + i) * a.N + n0;
      for (int l = 0; l < 16 && n0 + l < a.N; ++l) out[l] = bf16_round(lanes[l]);
#endif
    }
  }
}

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
  store<MT, NB>(a, m0, g0, acc);
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
        acc[i][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xsum[xb]), acc[i][j]);
      }
    }
  }
  store<MT, NB>(a, m0, g0, acc);
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
        const int64_t n = g * 16 + l;
        const float r = acc + (a.bias ? a.bias[n] : 0.f);
        if (a.y32) a.y32[m * a.N + n] = r;
        else a.y16[m * a.N + n] = bf16_round(r);
      }
#endif
}

// Row m of bf16 x quantized per block of 32 (act_quant.h), with s * sum(xq) for the
// blocks' m terms (llama.cpp's Q8_1 keeps the same product).
void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* xs, float* xsum) {
  act_quant::quantize_row(x, K, xq, [&](int64_t kb, float s, int32_t total) {
    xs[kb] = s;
    xsum[kb] = s * static_cast<float>(total);
  });
}

at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n_out, at::Tensor bias, bool float32_out) {
  NoGil no_gil;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "q4_gemm runs on the CPU");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "q4_gemm takes bfloat16 or float32 x");
  TORCH_CHECK(x.dim() == 2 && packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBytes,
              "q4_gemm: x [M, K], packed uint8 [ceil(N/16), K/32, 320]");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0);
  TORCH_CHECK(packed.size(1) * kBlock == K, "q4_gemm: x has K = ", K, ", the weights ", packed.size(1) * kBlock);
  TORCH_CHECK(n_out > 16 * (groups - 1) && n_out <= 16 * groups, "q4_gemm: n_out does not fit the groups");
  x = x.contiguous();
  packed = packed.contiguous();
  at::Tensor bias32;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == n_out, "q4_gemm: one bias per output");
    // In the model's dtype first (bf16 is rounded), added in float32, padded to whole groups.
    bias32 = at::zeros({groups * 16}, x.options().dtype(at::kFloat));
    bias32.narrow(0, 0, n_out).copy_(bias.to(x.scalar_type()).to(at::kFloat));
  }
  const bool out32 = float32_out || !bf16;
  at::Tensor y = at::empty({M, n_out}, x.options().dtype(out32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  Args a{nullptr, nullptr, nullptr, nullptr, packed.data_ptr<uint8_t>(),
         bias32.defined() ? bias32.data_ptr<float>() : nullptr,
         out32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
         out32 ? y.data_ptr<float>() : nullptr, K, n_out};
  // x prepared once, in buffers this thread keeps: quantized (VNNI), or widened to float32.
  thread_local std::vector<float> widened, scales, sums;
  thread_local std::vector<int8_t> quantized;
  const bool vnni = TOKENMILL_Q4_VNNI && bf16;
  const int64_t kb_count = K / kBlock;
  const uint16_t* x16 = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  if (vnni) {
    quantized.resize(static_cast<size_t>(M * K));
    scales.resize(static_cast<size_t>(M * kb_count));
    sums.resize(static_cast<size_t>(M * kb_count));
    int8_t* xq = quantized.data();
    float* xs = scales.data();
    float* xsum = sums.data();
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; ++m) quantize_row(x16 + m * K, K, xq + m * K, xs + m * kb_count, xsum + m * kb_count);
    a.xq = xq;
    a.xs = xs;
    a.xsum = xsum;
  } else if (bf16) {
    widened.resize(static_cast<size_t>(M * K));
    float* dst = widened.data();
    const int64_t total = M * K;
#pragma omp parallel for schedule(static) if (total >= (1 << 16))
    for (int64_t i = 0; i < total; ++i) {
      const uint32_t u = static_cast<uint32_t>(x16[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    a.x = dst;
  } else {
    a.x = x.data_ptr<float>();
  }
  // One task: kMaxGroups groups (48 outputs) for every row; the team splits the tasks evenly.
  const int64_t tasks = (groups + kMaxGroups - 1) / kMaxGroups;
#pragma omp parallel for schedule(static) if (tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t g0 = t * kMaxGroups;
    task(a, M, g0, static_cast<int>(std::min<int64_t>(kMaxGroups, groups - g0)), vnni);
  }
  return y;
}

}  // namespace q4

// packed_gemm's and packed_gemm_silu's Q4_1 case (uint8 weights of 320-byte blocks).
at::Tensor q4_gemm(at::Tensor x, at::Tensor packed, int64_t n_out, at::Tensor bias, bool float32_out) {
  return q4::gemm(x, packed, n_out, bias, float32_out);
}

// The MLP's gate_up on Q4_1 weights: silu(gate) * up from the rounded sums, as silu_and_mul.
at::Tensor q4_gemm_silu(at::Tensor x, at::Tensor packed, int64_t inter) {
  return silu_and_mul(q4_gemm(x, packed, 2 * inter, at::Tensor(), false));
}
