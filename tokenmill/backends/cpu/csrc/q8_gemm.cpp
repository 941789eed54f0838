// y = x W^T (+ bias) on Q8_0 weights kept quantized (quantization="q8_0";
// model/quantization.py): GGUF's blocks of 32 int8 q and a float16 scale d,
// standing for q * d.
//
// Packed layout (memory.pack_q8_0; zero rows pad N to a multiple of 16):
//   packed[g][kb] = 544 bytes: 16 float16 d (lane j: output 16 g + j), then
//                   q[k][j] for k = 0..31, j = 0..15 (input 32 kb + k)
//   shape [ceil(N/16), K/32, 544] uint8
// so a group g (16 outputs, all of K) is one stretch read front to back, 1.0625
// bytes a weight (bf16: 2), and 16 bytes of it widen to one vector of 16 outputs.
//
// The math: each 16 q widened to float32 and multiplied by their d, which is
// exact (8 and 11 significant bits in 24): the weights are the dequantized
// reference's to the bit. Then one float32 FMA a k and row, k in order, in
// tiles of up to 6 rows x 3 groups (18 accumulators), the same sequence of
// operations for a row whatever the other rows of the call: a row's result
// does not depend on the batch (as packed_gemm). Activations stay float (bf16
// x widened, not quantized to int8 as llama.cpp's VNNI path does): the sums
// differ from the float32 reference by order only. Decode rows (the case this
// format is for) are bound by the weight read; prefill rows by the float32
// FMAs (16 MACs an instruction against vdpbf16ps's 32), ~2x slower than bf16.
//
//   x [M, K] bf16 or float32, packed as above, n_out = N, bias [N] or empty
//   -> y [M, N] in x's dtype, or float32 with float32_out (the logits)
#include <torch/extension.h>

#include "no_gil.h"

#include <algorithm>
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

at::Tensor silu_and_mul(at::Tensor gate_up);

namespace {

constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8Bytes = 32 + kQ8Block * 16;  // 16 float16 scales, 32 x 16 int8
constexpr int kMaxRows = 6, kMaxGroups = 3;

struct Q8Args {
  const float* x;       // [M, K] float32
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

#if TOKENMILL_Q8_AVX512
inline __m512 widen_q(const uint8_t* p) {  // 16 int8 -> 16 float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Rows m0 .. m0+MT of x times groups g0 .. g0+NB.
template <int MT, int NB>
void q8_tile(const Q8Args& a, int64_t m0, int64_t g0) {
  const int64_t kb_count = a.K / kQ8Block, group_bytes = kb_count * kQ8Bytes;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* base[NB];
  for (int j = 0; j < NB; ++j) base[j] = a.w + (g0 + j) * group_bytes;
  const float* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.x + (m0 + i) * a.K;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    __m512 d[NB];
    for (int j = 0; j < NB; ++j)
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[j] + kb * kQ8Bytes)));
    const int64_t k0 = kb * kQ8Block;
    for (int k = 0; k < kQ8Block; ++k) {
      __m512 w[NB];
      for (int j = 0; j < NB; ++j) w[j] = _mm512_mul_ps(widen_q(base[j] + kb * kQ8Bytes + 32 + 16 * k), d[j]);
      for (int i = 0; i < MT; ++i) {
        const __m512 xb = _mm512_set1_ps(xr[i][k0 + k]);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (g0 + j) * 16;
    const __mmask16 mask = a.N - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.N - n0)) - 1);
    const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MT; ++i) {
      const __m512 r = _mm512_add_ps(acc[i][j], bias);  // + 0 leaves the sum as it is
      if (a.y32) {
        _mm512_mask_storeu_ps(a.y32 + (m0 + i) * a.N + n0, mask, r);
      } else {
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16(a.y16 + (m0 + i) * a.N + n0, mask, (__m256i)_mm512_cvtneps_pbh(r));
        continue;
#endif
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, r);
        uint16_t* out = a.y16 + (m0 + i) * a.N + n0;
        for (int l = 0; l < 16 && n0 + l < a.N; ++l) out[l] = bf16_round(lanes[l]);
      }
    }
  }
}

template <int MT>
void q8_rows(const Q8Args& a, int64_t m0, int64_t g0, int nb) {
  if (nb == 3) q8_tile<MT, 3>(a, m0, g0);
  else if (nb == 2) q8_tile<MT, 2>(a, m0, g0);
  else q8_tile<MT, 1>(a, m0, g0);
}
#endif

// Rows [0, M) times groups g0 .. g0+nb (<= kMaxGroups), in row tiles of up to kMaxRows.
void q8_task(const Q8Args& a, int64_t M, int64_t g0, int nb) {
#if TOKENMILL_Q8_AVX512
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, M - m0)) {
      case 6: q8_rows<6>(a, m0, g0, nb); break;
      case 5: q8_rows<5>(a, m0, g0, nb); break;
      case 4: q8_rows<4>(a, m0, g0, nb); break;
      case 3: q8_rows<3>(a, m0, g0, nb); break;
      case 2: q8_rows<2>(a, m0, g0, nb); break;
      default: q8_rows<1>(a, m0, g0, nb); break;
    }
  }
#else  // the same sums, one lane at a time
  const int64_t kb_count = a.K / kQ8Block, group_bytes = kb_count * kQ8Bytes;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = g0; g < g0 + nb; ++g)
      for (int l = 0; l < 16 && g * 16 + l < a.N; ++l) {
        float acc = 0.f;
        for (int64_t kb = 0; kb < kb_count; ++kb) {
          const uint8_t* blk = a.w + g * group_bytes + kb * kQ8Bytes;
          at::Half h;
          std::memcpy(&h, blk + 2 * l, 2);
          const float d = static_cast<float>(h);
          for (int k = 0; k < kQ8Block; ++k)
            acc = std::fma(a.x[m * a.K + kb * kQ8Block + k], static_cast<float>(static_cast<int8_t>(blk[32 + 16 * k + l])) * d, acc);
        }
        const int64_t n = g * 16 + l;
        const float r = acc + (a.bias ? a.bias[n] : 0.f);
        if (a.y32) a.y32[m * a.N + n] = r;
        else a.y16[m * a.N + n] = bf16_round(r);
      }
#endif
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
  // x as float32: widened once (bf16 -> float32 is exact), in a buffer this thread keeps.
  const float* xf = nullptr;
  thread_local std::vector<float> widened;
  if (bf16) {
    widened.resize(static_cast<size_t>(M * K));
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    float* dst = widened.data();
    const int64_t total = M * K;
#pragma omp parallel for schedule(static) if (total >= (1 << 16))
    for (int64_t i = 0; i < total; ++i) {
      const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    xf = dst;
  } else {
    xf = x.data_ptr<float>();
  }
  Q8Args a{xf, packed.data_ptr<uint8_t>(), bias32.defined() ? bias32.data_ptr<float>() : nullptr,
           out32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
           out32 ? y.data_ptr<float>() : nullptr, K, n_out};
  // One task: kMaxGroups groups (48 outputs) for every row; the team splits the tasks evenly.
  const int64_t tasks = (groups + kMaxGroups - 1) / kMaxGroups;
#pragma omp parallel for schedule(static) if (tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t g0 = t * kMaxGroups;
    q8_task(a, M, g0, static_cast<int>(std::min<int64_t>(kMaxGroups, groups - g0)));
  }
  return y;
}

// The MLP's gate_up on Q8_0 weights: silu(gate) * up from the rounded sums, as
// silu_and_mul computes it (the bf16 GEMM fuses the same function into its tiles).
at::Tensor q8_gemm_silu(at::Tensor x, at::Tensor packed, int64_t inter) {
  return silu_and_mul(q8_gemm(x, packed, 2 * inter, at::Tensor(), false));
}
