// One driver for every block format (weights in blocks of 32 inputs with their
// own scales: Q8_0, Q4_1, ...): the argument checks, the bias, x prepared once
// (quantized per block of 32 by act_quant.h for the int8 dot products, or
// widened to float32), and the task loop. A format brings only its layout and
// its tiles, as a traits struct F:
//
//   static constexpr const char* kName;          // for errors
//   using Term = int32_t or float;               // a block's term of sum(xq), from
//   static Term term(float s, int32_t total);    //   act_quant's (scale, sum of xq)
//   static int64_t group_bytes(int64_t K);       // bytes of 16 outputs (a group), all of K
//   static void tasks(const BlockArgs<Term>& a, int64_t M, int64_t t0, int64_t t1, int64_t groups, bool vnni);
//       // tasks [t0, t1) (a task: kTaskGroups groups, every row) on this thread, its
//       // prefetch state its own; `vnni`: a.xq / a.xs / a.xt hold x, else a.x (float32)
//   static constexpr bool kVnni;                 // built with the int8 dot (AVX512-VNNI)
//
// A format whose activation scale spans more than a block (the k-quants: llama.cpp's
// Q8_K, 256 inputs) says so, and keeps several terms a scale block in place of term():
//   static constexpr int64_t kActBlock;          // inputs an activation scale (a multiple of 32)
//   static constexpr int64_t kTermsPerBlock;     // terms a scale block
//   static void terms(float s, int32_t total, const int8_t* xq, Term* out);  // from its int8 x
//
// Each output is its row's sequence of operations whatever the other rows of
// the call or the thread that takes its task: the batch changes no bit.
#pragma once

#include <torch/extension.h>

#include "act_quant.h"
#include "formats.h"
#include "no_gil.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

at::Tensor silu_and_mul(at::Tensor gate_up);  // (fused_ops.cpp)

namespace block_gemm {

constexpr int64_t kBlock = 32;     // inputs a block (act_quant.h's too)
constexpr int kTaskGroups = 3;     // groups of 16 outputs a task

// A format's activation block and terms a block (header comment): 32 and 1 unless it says.
template <typename F>
constexpr int64_t act_block() {
  if constexpr (requires { F::kActBlock; }) return F::kActBlock;
  else return kBlock;
}
template <typename F>
constexpr int64_t terms_per_block() {
  if constexpr (requires { F::kTermsPerBlock; }) return F::kTermsPerBlock;
  else return 1;
}

template <typename Term>
struct BlockArgs {
  const float* x;     // [M, K] float32 (the float path)
  const int8_t* xq;   // [M, K] x quantized (the int8 path)
  const float* xs;    // [M, K/32] its scales
  const Term* xt;     // [M, K/32] the format's term of each block's sum(xq)
  const uint8_t* w;   // the packed weight
  const float* bias;  // [groups * 16] float32, or null
  uint16_t* y16;      // [M, N] bf16 out, or null
  float* y32;         // [M, N] float32 out, or null
  int64_t K, N;
};

inline uint16_t bf16_round(float f) {  // nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The tile's accumulators (+ bias) to y: lanes are outputs 16 (g0 + j) .. +16,
// the last group of an N that is not a multiple of 16 only its real lanes.
template <typename Term, int MT, int NB>
inline void store(const BlockArgs<Term>& a, int64_t m0, int64_t g0, __m512 (&acc)[MT][NB]) {
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
#endif

// One output of the scalar build: its float32 sum (+ bias) to y.
template <typename Term>
inline void store_one(const BlockArgs<Term>& a, int64_t m, int64_t n, float acc) {
  const float r = acc + (a.bias ? a.bias[n] : 0.f);
  if (a.y32) a.y32[m * a.N + n] = r;
  else a.y16[m * a.N + n] = bf16_round(r);
}

// y = x W^T (+ bias) on w in format F: x [M, K] bf16 or float32 -> [M, N] in
// x's dtype, or float32 with float32_out (the logits).
// side: GemmSide's work, in the tasks' region.
template <typename F>
at::Tensor gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const GemmSide* side) {
  using Term = typename F::Term;
  NoGil no_gil;
  const at::Tensor& packed = w.data;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), F::kName, " GEMM runs on the CPU");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, F::kName, " GEMM takes bfloat16 or float32 x");
  const int64_t M = x.size(0), K = x.size(1), groups = (w.n + 15) / 16;
  TORCH_CHECK(x.dim() == 2 && K == w.k, F::kName, " GEMM: x [M, K] with K = ", w.k, " (the weight's), got ",
              x.sizes());
  TORCH_CHECK(K % act_block<F>() == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == groups * F::group_bytes(K),
              F::kName, " GEMM: the packed weight is not ", groups, " groups of ", F::group_bytes(K),
              " bytes (pack it with formats.pack)");
  x = x.contiguous();
  at::Tensor bias32;
  if (w.bias.defined() && w.bias.numel() > 0) {
    TORCH_CHECK(w.bias.numel() == w.n, F::kName, " GEMM: one bias per output");
    // In the model's dtype first (bf16 is rounded), added in float32, padded to whole groups.
    bias32 = at::zeros({groups * 16}, x.options().dtype(at::kFloat));
    bias32.narrow(0, 0, w.n).copy_(w.bias.to(x.scalar_type()).to(at::kFloat));
  }
  const bool out32 = float32_out || !bf16;
  at::Tensor y = at::empty({M, w.n}, x.options().dtype(out32 ? at::kFloat : at::kBFloat16));
  if (M == 0) {
    if (side) side->alone(y);
    return y;
  }
  BlockArgs<Term> a{nullptr, nullptr, nullptr, nullptr, packed.data_ptr<uint8_t>(),
                    bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                    out32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                    out32 ? y.data_ptr<float>() : nullptr, K, w.n};
  // x prepared once, in buffers this thread keeps: quantized (int8 path), or widened to float32.
  thread_local std::vector<float> widened, scales;
  thread_local std::vector<int8_t> quantized;
  thread_local std::vector<Term> terms;
  const bool vnni = F::kVnni && bf16;
  constexpr int64_t AB = act_block<F>(), TB = terms_per_block<F>();
  const int64_t kb_count = K / AB;
  const uint16_t* x16 = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  if (vnni) {
    quantized.resize(static_cast<size_t>(M * K));
    scales.resize(static_cast<size_t>(M * kb_count));
    terms.resize(static_cast<size_t>(M * kb_count * TB));
    int8_t* xq = quantized.data();
    float* xs = scales.data();
    Term* xt = terms.data();
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; ++m)
      act_quant::quantize_row<AB>(x16 + m * K, K, xq + m * K, [&](int64_t kb, float s, int32_t total) {
        xs[m * kb_count + kb] = s;
        if constexpr (requires { &F::terms; }) F::terms(s, total, xq + m * K + kb * AB, xt + (m * kb_count + kb) * TB);
        else xt[m * kb_count + kb] = F::term(s, total);
      });
    a.xq = xq;
    a.xs = xs;
    a.xt = xt;
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
  // Each thread takes a contiguous share of the tasks (one address-ordered stream of its own).
  const int64_t tasks = (groups + kTaskGroups - 1) / kTaskGroups;
#pragma omp parallel if (tasks > 1 || (side && side->wants_team()))
  {
    if (side) side->before();
    const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t t0 = tasks * id / team, t1 = tasks * (id + 1) / team;
    if (t0 < t1) F::tasks(a, M, t0, t1, groups, vnni);
    if (side) {
#pragma omp barrier
      side->after(y);
    }
  }
  return y;
}

// The MLP's gate_up in format F: silu(gate) * up from the rounded sums, as
// silu_and_mul computes it (the bf16 GEMM fuses the same function into its tiles).
template <typename F>
at::Tensor gemm_silu(at::Tensor x, const PackedWeight& w) {
  TORCH_CHECK(w.n % 2 == 0 && !(w.bias.defined() && w.bias.numel() > 0), F::kName,
              " GEMM: gate_up has an even number of outputs and no bias");
  return silu_and_mul(gemm<F>(std::move(x), w, false, nullptr));
}

}  // namespace block_gemm
