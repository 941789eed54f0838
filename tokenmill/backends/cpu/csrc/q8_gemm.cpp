// y = x W^T (+ bias) on Q8_0 weights kept quantized (quantization="q8_0";
// model/quantization.py): GGUF's blocks of 32 int8 q and a float16 scale d,
// standing for q * d.
//
// Packed layout (memory.pack_q8_0; zero rows pad N to a multiple of 16):
//   packed[g][kb] = 544 bytes: 16 float16 d (lane j: output 16 g + j), then
//                   for each 4 inputs (kk = 0..7) and lane j, 4 bytes q + 128
//                   (unsigned): q[16 g + j][32 kb + 4 kk + t] + 128, t = 0..3
//   shape [ceil(N/16), K/32, 544] uint8
// so a group g (16 outputs, all of K) is one stretch read front to back, 1.0625
// bytes a weight (bf16: 2), and 64 bytes are one vpdpbusd operand: 4 inputs for
// each of 16 outputs.
//
// Two ways, by the activations' dtype:
// - bfloat16 x (the served dtype): as llama.cpp's Q8_0 x Q8_0 dot, x is
//   quantized per row and block of 32 to int8 (s = max|x| / 127, xq = round(x / s),
//   s kept in float32), and vpdpbusd (AVX512-VNNI) sums 4 products (q + 128) * xq
//   a lane a step in int32, exactly; the +128 is taken back out by starting each
//   block's sum at -128 * sum(xq). A block adds (d s) * its sum to float32
//   accumulators. What this computes differs from the dequantized reference by
//   x's rounding to int8: at most s / 2 an input, i.e. |y - ref| <=
//   sum_k |q d| s_k / 2 (tests/test_quantization.py holds it to that bound).
//   Reading the weights bounds it at decode (8 instructions a 512 weights and row).
// - float32 x (and bf16 x without VNNI): each q widened to float32 and multiplied
//   by its d, which is exact (8 and 11 significant bits in 24): the weights are
//   the dequantized reference's to the bit, and one float32 FMA a k and row,
//   k in order; only the order of the sums differs from the reference.
// Either way a row's result is the same sequence of operations whatever the
// other rows of the call (tiles of up to 4 or 6 rows x 3 groups): the batch
// does not change a row's bits (as packed_gemm).
//
//   x [M, K] bf16 or float32, packed as above, n_out = N, bias [N] or empty
//   -> y [M, N] in x's dtype, or float32 with float32_out (the logits)
#include <torch/extension.h>

#include "no_gil.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TOKENMILL_Q8_AVX512 1
#else
#define TOKENMILL_Q8_AVX512 0
#endif
#if TOKENMILL_Q8_AVX512 && defined(__AVX512VNNI__)
#define TOKENMILL_Q8_VNNI 1
#else
#define TOKENMILL_Q8_VNNI 0
#endif

at::Tensor silu_and_mul(at::Tensor gate_up);

namespace {

constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8Bytes = 32 + kQ8Block * 16;  // 16 float16 scales, 32 x 16 bytes
constexpr int kMaxGroups = 3;
// The VNNI tile asks for each group's bytes this far ahead of its loads (a few
// blocks): at one row the hardware prefetcher alone left the read at ~30 GB/s.
constexpr int64_t kPrefetchBytes = 2048;

struct Q8Args {
  const float* x;       // [M, K] float32 (the float path)
  const int8_t* xq;     // [M, K] x quantized (the VNNI path)
  const float* xs;      // [M, K/32] its scales
  const int32_t* xc;    // [M, K/32] -128 * the block's sum of xq
  const uint8_t* w;     // packed
  const float* bias;    // [G * 16] float32, or null
  uint16_t* y16;        // [M, N] bf16 out, or null
  float* y32;           // [M, N] float32 out, or null
  int64_t K, N;
};

inline uint16_t bf16_round(float f) {  // nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The weight of output lane j, input 32 kb + k, in a block (scalar code and tests).
inline float q8_weight(const uint8_t* blk, int j, int k) {
  at::Half h;
  std::memcpy(&h, blk + 2 * j, 2);
  const int q = static_cast<int>(blk[32 + (k / 4) * 64 + 4 * j + k % 4]) - 128;
  return static_cast<float>(q) * static_cast<float>(h);
}

#if TOKENMILL_Q8_AVX512
template <int MT, int NB>
inline void q8_store(const Q8Args& a, int64_t m0, int64_t g0, __m512 (&acc)[MT][NB]) {
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
void q8_tile_float(const Q8Args& a, int64_t m0, int64_t g0) {
  const int64_t kb_count = a.K / kQ8Block, group_bytes = kb_count * kQ8Bytes;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = a.w + (g0 + j) * group_bytes;
  const float* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.x + (m0 + i) * a.K;
  const __m512i flip = _mm512_set1_epi32(int32_t(0x80808080u));  // q + 128 -> q as signed bytes
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    __m512 d[NB];
    for (int j = 0; j < NB; ++j)
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[j] + kb * kQ8Bytes)));
    const int64_t k0 = kb * kQ8Block;
    for (int kk = 0; kk < 8; ++kk) {
      __m512i v[NB];
      for (int j = 0; j < NB; ++j)
        v[j] = _mm512_xor_si512(
            _mm512_loadu_si512(reinterpret_cast<const void*>(base[j] + kb * kQ8Bytes + 32 + 64 * kk)), flip);
      for (int t = 0; t < 4; ++t) {
        __m512 w[NB];
        for (int j = 0; j < NB; ++j) {  // byte t of each lane, sign-extended: q exactly; * d exact
          const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v[j], 24 - 8 * t), 24);
          w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d[j]);
        }
        for (int i = 0; i < MT; ++i) {
          const __m512 xb = _mm512_set1_ps(xr[i][k0 + 4 * kk + t]);
          for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
        }
      }
    }
  }
  q8_store<MT, NB>(a, m0, g0, acc);
}

#if TOKENMILL_Q8_VNNI
// The VNNI path: rows m0 .. m0+MT of quantized x times groups g0 .. g0+NB.
// pf, if not null: the next task's groups (pf_bytes, one contiguous stretch),
// fetched into L2 in address order while this tile runs, a kb_count-th of
// them a block (NB lines a step, the rest at the block's end), as
// packed_gemm's tiles fetch their next group: at one row the in-group 2 KB
// prefetch alone left the read at ~23-30 GB/s. Prefetches change no bits.
template <int MT, int NB>
void q8_tile_vnni(const Q8Args& a, int64_t m0, int64_t g0, const uint8_t* pf, int64_t pf_bytes) {
  const int64_t kb_count = a.K / kQ8Block, group_bytes = kb_count * kQ8Bytes;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = a.w + (g0 + j) * group_bytes;
  const char* pp = reinterpret_cast<const char*>(pf);  // the next line to fetch
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    // This block's share of the next task's stretch ends here.
    const char* const pend = pf ? reinterpret_cast<const char*>(pf) + pf_bytes * (kb + 1) / kb_count : nullptr;
    __m512i sum[MT][NB];
    for (int i = 0; i < MT; ++i) {
      const __m512i start = _mm512_set1_epi32(a.xc[(m0 + i) * kb_count + kb]);
      for (int j = 0; j < NB; ++j) sum[i][j] = start;
    }
    for (int kk = 0; kk < 8; ++kk) {
      __m512i w[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = base[j] + kb * kQ8Bytes + 32 + 64 * kk;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);  // (past a group's end: harmless)
        w[j] = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
      }
      for (int i = 0; i < MT; ++i) {
        int32_t four;
        std::memcpy(&four, a.xq + (m0 + i) * a.K + kb * kQ8Block + 4 * kk, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int j = 0; j < NB; ++j) sum[i][j] = _mm512_dpbusd_epi32(sum[i][j], w[j], xb);
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
      const __m512 d =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[j] + kb * kQ8Bytes)));
      for (int i = 0; i < MT; ++i) {
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.xs[(m0 + i) * kb_count + kb]));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][j]), ds, acc[i][j]);
      }
    }
  }
  q8_store<MT, NB>(a, m0, g0, acc);
}
#endif

template <bool VNNI, int MT>
void q8_rows(const Q8Args& a, int64_t m0, int64_t g0, int nb, const uint8_t* pf, int64_t pf_bytes) {
#if TOKENMILL_Q8_VNNI
  if constexpr (VNNI) {
    if (nb == 3) q8_tile_vnni<MT, 3>(a, m0, g0, pf, pf_bytes);
    else if (nb == 2) q8_tile_vnni<MT, 2>(a, m0, g0, pf, pf_bytes);
    else q8_tile_vnni<MT, 1>(a, m0, g0, pf, pf_bytes);
    return;
  }
#else
  (void)pf;
  (void)pf_bytes;
#endif
  if (nb == 3) q8_tile_float<MT, 3>(a, m0, g0);
  else if (nb == 2) q8_tile_float<MT, 2>(a, m0, g0);
  else q8_tile_float<MT, 1>(a, m0, g0);
}
#endif

// Rows [0, M) times groups g0 .. g0+nb (<= kMaxGroups), in row tiles (VNNI: 4
// rows, its int32 and float32 accumulators both in registers; float: 6).
// VNNI: the first row tile prefetches the next task's groups (the rest read them from L2).
void q8_task(const Q8Args& a, int64_t M, int64_t g0, int nb, bool vnni) {
#if TOKENMILL_Q8_AVX512
  if (vnni) {
    const int64_t groups = (a.N + 15) / 16, group_bytes = a.K / kQ8Block * kQ8Bytes;
    const int64_t next = std::min<int64_t>(kMaxGroups, groups - (g0 + nb));
    const uint8_t* pf = next > 0 ? a.w + (g0 + nb) * group_bytes : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const uint8_t* p = m0 == 0 ? pf : nullptr;
      const int64_t pb = p ? next * group_bytes : 0;
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: q8_rows<true, 4>(a, m0, g0, nb, p, pb); break;
        case 3: q8_rows<true, 3>(a, m0, g0, nb, p, pb); break;
        case 2: q8_rows<true, 2>(a, m0, g0, nb, p, pb); break;
        default: q8_rows<true, 1>(a, m0, g0, nb, p, pb); break;
      }
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 6) {
    switch (std::min<int64_t>(6, M - m0)) {
      case 6: q8_rows<false, 6>(a, m0, g0, nb, nullptr, 0); break;
      case 5: q8_rows<false, 5>(a, m0, g0, nb, nullptr, 0); break;
      case 4: q8_rows<false, 4>(a, m0, g0, nb, nullptr, 0); break;
      case 3: q8_rows<false, 3>(a, m0, g0, nb, nullptr, 0); break;
      case 2: q8_rows<false, 2>(a, m0, g0, nb, nullptr, 0); break;
      default: q8_rows<false, 1>(a, m0, g0, nb, nullptr, 0); break;
    }
  }
#else  // the float path's sums, one lane at a time
  (void)vnni;
  const int64_t kb_count = a.K / kQ8Block, group_bytes = kb_count * kQ8Bytes;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = g0; g < g0 + nb; ++g)
      for (int l = 0; l < 16 && g * 16 + l < a.N; ++l) {
        float acc = 0.f;
        for (int64_t kb = 0; kb < kb_count; ++kb)
          for (int k = 0; k < kQ8Block; ++k)
            acc = std::fma(a.x[m * a.K + kb * kQ8Block + k], q8_weight(a.w + g * group_bytes + kb * kQ8Bytes, l, k),
                           acc);
        const int64_t n = g * 16 + l;
        const float r = acc + (a.bias ? a.bias[n] : 0.f);
        if (a.y32) a.y32[m * a.N + n] = r;
        else a.y16[m * a.N + n] = bf16_round(r);
      }
#endif
}

// Row m of bf16 x quantized per block of 32 as llama.cpp's quantize_row_q8_0
// (s = max|x| / 127, xq = x * (1 / s) rounded to the nearest integer, ties to
// even as its AVX code; the scale kept in float32).
void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* xs, int32_t* xc) {
  for (int64_t kb = 0; kb < K / kQ8Block; ++kb) {
#if TOKENMILL_Q8_VNNI
    const __m256i* src = reinterpret_cast<const __m256i*>(x + kb * kQ8Block);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src + 1)), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));  // (nearest, ties even)
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + kb * kQ8Block), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + kb * kQ8Block + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
    float v[kQ8Block], amax = 0.f;
    for (int k = 0; k < kQ8Block; ++k) {
      const uint32_t u = static_cast<uint32_t>(x[kb * kQ8Block + k]) << 16;
      std::memcpy(&v[k], &u, 4);
      amax = std::max(amax, std::fabs(v[k]));
    }
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    int32_t total = 0;
    for (int k = 0; k < kQ8Block; ++k) {
      const int8_t q = static_cast<int8_t>(std::nearbyint(v[k] * inv));  // |v * inv| <= 127: no overflow
      xq[kb * kQ8Block + k] = q;
      total += q;
    }
#endif
    xs[kb] = s;
    xc[kb] = -128 * total;
  }
}

}  // namespace

// packed_gemm's and packed_gemm_silu's Q8_0 case (they hand uint8 weights here).
at::Tensor q8_gemm(at::Tensor x, at::Tensor packed, int64_t n_out, at::Tensor bias, bool float32_out) {
  NoGil no_gil;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "q8_gemm runs on the CPU");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "q8_gemm takes bfloat16 or float32 x");
  TORCH_CHECK(x.dim() == 2 && packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kQ8Bytes,
              "q8_gemm: x [M, K], packed uint8 [ceil(N/16), K/32, 544]");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0);
  TORCH_CHECK(packed.size(1) * kQ8Block == K, "q8_gemm: x has K = ", K, ", the weights ", packed.size(1) * kQ8Block);
  TORCH_CHECK(n_out > 16 * (groups - 1) && n_out <= 16 * groups, "q8_gemm: n_out does not fit the groups");
  x = x.contiguous();
  packed = packed.contiguous();
  at::Tensor bias32;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == n_out, "q8_gemm: one bias per output");
    // In the model's dtype first (bf16 is rounded), added in float32, padded to whole groups.
    bias32 = at::zeros({groups * 16}, x.options().dtype(at::kFloat));
    bias32.narrow(0, 0, n_out).copy_(bias.to(x.scalar_type()).to(at::kFloat));
  }
  const bool out32 = float32_out || !bf16;
  at::Tensor y = at::empty({M, n_out}, x.options().dtype(out32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  Q8Args a{nullptr, nullptr, nullptr, nullptr, packed.data_ptr<uint8_t>(),
           bias32.defined() ? bias32.data_ptr<float>() : nullptr,
           out32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
           out32 ? y.data_ptr<float>() : nullptr, K, n_out};
  // x prepared once, in buffers this thread keeps: quantized (VNNI), or widened to float32.
  thread_local std::vector<float> widened, scales;
  thread_local std::vector<int8_t> quantized;
  thread_local std::vector<int32_t> corrections;
  const bool vnni = TOKENMILL_Q8_VNNI && bf16;
  const int64_t kb_count = K / kQ8Block;
  const uint16_t* x16 = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  if (vnni) {
    quantized.resize(static_cast<size_t>(M * K));
    scales.resize(static_cast<size_t>(M * kb_count));
    corrections.resize(static_cast<size_t>(M * kb_count));
    int8_t* xq = quantized.data();
    float* xs = scales.data();
    int32_t* xc = corrections.data();
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; ++m) quantize_row(x16 + m * K, K, xq + m * K, xs + m * kb_count, xc + m * kb_count);
    a.xq = xq;
    a.xs = xs;
    a.xc = xc;
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
    q8_task(a, M, g0, static_cast<int>(std::min<int64_t>(kMaxGroups, groups - g0)), vnni);
  }
  return y;
}

// The MLP's gate_up on Q8_0 weights: silu(gate) * up from the rounded sums, as
// silu_and_mul computes it (the bf16 GEMM fuses the same function into its tiles).
at::Tensor q8_gemm_silu(at::Tensor x, at::Tensor packed, int64_t inter) {
  return silu_and_mul(q8_gemm(x, packed, 2 * inter, at::Tensor(), false));
}
