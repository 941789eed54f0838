// y = x W^T (+ bias) in bfloat16 for few rows of x (decode steps of small batches).
//
// There the weights are read from memory once per step and the matmul is bound
// by memory bandwidth; torch's bf16 matmul reaches about a third of it at these
// shapes (the weights never stay in cache between steps). This kernel streams
// each thread's share of W once, in blocks of 16 weight rows: tiles of rows of
// x times rows of W with 16 float32 accumulators fed by vdpbf16ps (AVX512-BF16)
// over K in chunks of 32, folded into 16 outputs by one transpose-add tree. A
// block's weight rows stay in L1/L2 while the rows of x pass over them.
//
//   x [M, K] bf16, weight [N, K] bf16, bias [N] bf16 or empty -> y [M, N] bf16,
//   or float32 with float32_out (the logits: no rounding of the sums at all)
//   requires K % 32 == 0 and N % 16 == 0 (skinny_gemm_supported says so).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include "cpu_vec.h"

namespace {

inline float bf16_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

bool skinny_gemm_supported(at::Tensor x, at::Tensor weight) {
  return x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
         x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) &&
         x.size(1) % 32 == 0 && weight.size(0) % 16 == 0 && x.is_contiguous() &&
         weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu();
}

// One tile: MT rows of x times NT = 16 / MT rows of W (starting at w0), 16
// accumulators; lane i * NT + j of the result = x[i] . w[j]. `pf`, if not null: the same
// rows of the next block, fetched into cache meanwhile.
template <int MT>
inline __m512 tile(const uint16_t* const* xr, const uint16_t* w0, int64_t K, const uint16_t* pf) {
  constexpr int NT = 16 / MT;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NT], xv[MT];
    for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w0 + j * K + k);
    for (int i = 0; i < MT; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(xr[i] + k);
    if (pf)
      for (int j = 0; j < NT; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * K + k), _MM_HINT_T0);
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) acc[i * NT + j] = _mm512_dpbf16_ps(acc[i * NT + j], xv[i], wv[j]);
  }
  return hsum16(acc);
}

at::Tensor skinny_gemm(at::Tensor x, at::Tensor weight, at::Tensor bias, bool float32_out) {
  TORCH_CHECK(skinny_gemm_supported(x, weight),
              "skinny_gemm needs contiguous bf16 CPU x [M, K], weight [N, K], K % 32 == 0, N % 16 == 0");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (has_bias) bias = bias.to(at::kBFloat16).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const uint16_t* bp = has_bias ? reinterpret_cast<const uint16_t*>(bias.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* yp = float32_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  float* yf = float32_out ? y.data_ptr<float>() : nullptr;

  // Blocks of 16 weight rows; inside one, rows of x go 4 at a time (tiles of
  // 4 x 4), then 2 (2 x 8), then 1 (1 x 16), so no lane computes a padding row.
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    // The first pass over this block's weights prefetches the next block's.
    const uint16_t* next = n0 + 16 < N ? wp + (n0 + 16) * K : nullptr;
    // Lane i * nt + j -> y[m0 + i][nb + j]: bias added in float32, one rounding
    // to bf16 (nearest even, as torch), nt outputs of a row stored together.
    auto emit = [&](__m512 r, int64_t m0, int mt, int64_t nb, int nt) {
      if (bp) {
        alignas(64) float bias16[16];
        for (int k = 0; k < 16; ++k) bias16[k] = bf16_float(bp[nb + k % nt]);
        r = _mm512_add_ps(r, _mm512_load_ps(bias16));
      }
      if (yf) {  // float32 out: no rounding at all
        alignas(64) float f[16];
        _mm512_store_ps(f, r);
        for (int i = 0; i < mt; ++i) std::memcpy(yf + (m0 + i) * N + nb, f + i * nt, nt * sizeof(float));
        return;
      }
      alignas(32) uint16_t h[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), (__m256i)_mm512_cvtneps_pbh(r));
      for (int i = 0; i < mt; ++i)
        std::memcpy(yp + (m0 + i) * N + nb, h + i * nt, nt * sizeof(uint16_t));
    };
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) {
      const uint16_t* xr[4] = {xp + m0 * K, xp + (m0 + 1) * K, xp + (m0 + 2) * K, xp + (m0 + 3) * K};
      for (int64_t nb = n0; nb < n0 + 16; nb += 4) {
        emit(tile<4>(xr, wp + nb * K, K, m0 == 0 && next ? next + (nb - n0) * K : nullptr),
             m0, 4, nb, 4);
      }
    }
    for (; m0 + 2 <= M; m0 += 2) {
      const uint16_t* xr[2] = {xp + m0 * K, xp + (m0 + 1) * K};
      for (int64_t nb = n0; nb < n0 + 16; nb += 8) {
        emit(tile<2>(xr, wp + nb * K, K, m0 == 0 && next ? next + (nb - n0) * K : nullptr),
             m0, 2, nb, 8);
      }
    }
    if (m0 < M) {
      const uint16_t* xr[1] = {xp + m0 * K};
      emit(tile<1>(xr, wp + n0 * K, K, m0 == 0 ? next : nullptr), m0, 1, n0, 16);
    }
  }
  return y;
}
#else
bool skinny_gemm_supported(at::Tensor, at::Tensor) { return false; }
at::Tensor skinny_gemm(at::Tensor x, at::Tensor weight, at::Tensor bias, bool float32_out) {
  TORCH_CHECK(false, "skinny_gemm needs AVX512-BF16 (built without it)");
  return x;
}
#endif
