// The weight formats the packed GEMM serves, and a weight packed in one of them.
//
// A format is a row of one table (kFormats below; backends/cpu/formats.py holds
// the Python half of each row: how to pack it and its bytes per weight). The
// GEMM dispatches on PackedWeight::format and on nothing else: never on a
// tensor's dtype or shape.
//
// To add a format: a WeightFormat value, its row in kFormats (name, gemm,
// gemm_silu), and for a block format (blocks of 32 inputs, x quantized per 32
// by act_quant.h) a traits struct for block_gemm.h's driver: its packed group
// size and its tile, the dot product of its blocks with int8 activations (see
// q8_gemm.cpp and q4_gemm.cpp). Then its row in formats.py.
#pragma once

#include <torch/extension.h>

#include "kv_prefetch.h"

#include <cstdint>
#include <string>
#include <vector>

enum class WeightFormat : int64_t {
  kBF16 = 0,     // bfloat16 [ceil(N/16), K/2, 16, 2] (packed_gemm.cpp)
  kFloat32 = 1,  // float32 [ceil(N/16), K, 16] (packed_gemm.cpp)
  kQ8_0 = 2,     // GGUF Q8_0 blocks, 3 groups of 16 outputs interleaved a task (q8_gemm.cpp)
  kQ4_1 = 3,     // GGUF Q4_1 blocks (and Q4_0 fused with Q4_1), 320 bytes a block of 16 outputs (q4_gemm.cpp)
  kQ4_0 = 4,     // GGUF Q4_0, Q5_0, Q4_K, Q5_K, Q6_K blocks, a super-block of 16 outputs at a time (kq_gemm.cpp)
  kQ5_0 = 5,
  kQ4_K = 6,
  kQ5_K = 7,
  kQ6_K = 8,
  kParts = 9,  // output rows in parts of different formats, each a PackedWeight (parts_gemm.cpp)
};

// One weight [N, K] packed for the GEMM: its format, its shape, its bytes in
// that format's layout (each format's file says which), and its bias [N] (or
// empty). Built once per weight by the CPU plan (plan.py, formats.pack).
struct PackedWeight {
  WeightFormat format = WeightFormat::kBF16;
  int64_t n = 0, k = 0;  // output and input features
  at::Tensor data;
  at::Tensor bias;
  std::vector<PackedWeight> parts;  // kParts: the parts in row order (data and bias empty)
};

// Work a GEMM runs in its own parallel region besides its tiles, on the same
// team (the LoRA delta of the projection, lora_delta.cpp): one region a
// projection instead of two, each a wake-up of the team. before(): by every
// thread, before its tiles (it reads x only); after(y): by every thread, once
// every tile of y is written (after a barrier). Both share their work out
// with orphaned `omp for`s, so a team of one runs it too.
struct GemmSide {
  virtual ~GemmSide() = default;
  virtual void before() const = 0;
  virtual void after(const at::Tensor& y) const = 0;
  virtual bool wants_team() const = 0;  // enough work for a team where the GEMM has none
  // Both in a region of their own, after y is complete (a GEMM that hosts no side work).
  void alone(const at::Tensor& y) const {
#pragma omp parallel if (wants_team())
    {
      before();
#pragma omp barrier
      after(y);
    }
  }
};

// y = x W^T (+ bias): [M, K] bf16 or float32 -> [M, N] in x's dtype, or float32 with float32_out.
// kv: the K/V prefetch streams the call's tiles feed (kv_prefetch.h), empty
// outside the layer calls; only the dense tiles feed them (the block formats'
// entries take and ignore them: the prefetch was measured in bf16 only).
// side: work for the GEMM's region (GemmSide), or null; y is returned with it done.
using GemmFn = at::Tensor (*)(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                              const GemmSide* side);
// silu(gate) * up from gate_up weights ([gate; up], N = 2 inter) -> [M, inter].
using GemmSiluFn = at::Tensor (*)(at::Tensor x, const PackedWeight& w, const KvStreams& kv);

struct FormatRow {
  WeightFormat format;
  const char* name;  // formats.py's `kernel` of the rows that use it
  GemmFn gemm;
  GemmSiluFn gemm_silu;
};

// Each format's entries (defined in its own file).
at::Tensor dense_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor dense_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor q8_0_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor q8_0_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor q4_1_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor q4_1_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor q4_0_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor q4_0_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor q5_0_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor q5_0_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor q4_k_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor q4_k_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor q5_k_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor q5_k_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor q6_k_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor q6_k_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);
at::Tensor parts_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                     const GemmSide* side);
at::Tensor parts_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv);

// Indexed by WeightFormat.
inline constexpr FormatRow kFormats[] = {
    {WeightFormat::kBF16, "bfloat16", dense_gemm, dense_gemm_silu},
    {WeightFormat::kFloat32, "float32", dense_gemm, dense_gemm_silu},
    {WeightFormat::kQ8_0, "q8_0", q8_0_gemm, q8_0_gemm_silu},
    {WeightFormat::kQ4_1, "q4_1", q4_1_gemm, q4_1_gemm_silu},
    {WeightFormat::kQ4_0, "q4_0", q4_0_gemm, q4_0_gemm_silu},
    {WeightFormat::kQ5_0, "q5_0", q5_0_gemm, q5_0_gemm_silu},
    {WeightFormat::kQ4_K, "q4_k", q4_k_gemm, q4_k_gemm_silu},
    {WeightFormat::kQ5_K, "q5_k", q5_k_gemm, q5_k_gemm_silu},
    {WeightFormat::kQ6_K, "q6_k", q6_k_gemm, q6_k_gemm_silu},
    {WeightFormat::kParts, "parts", parts_gemm, parts_gemm_silu},
};
inline constexpr int64_t kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);

inline const FormatRow& format_row(const PackedWeight& w) {
  const int64_t f = static_cast<int64_t>(w.format);
  TORCH_CHECK(f >= 0 && f < kNumFormats, "unknown weight format ", f);
  return kFormats[f];
}

// y = x W^T (+ W's bias) in W's format: what every caller (the layer calls,
// the plan's Python loop, the head) runs; kv as GemmFn says (bindings.cpp passes none).
inline at::Tensor packed_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                              const GemmSide* side = nullptr) {
  return format_row(w).gemm(std::move(x), w, float32_out, kv, side);
}
inline at::Tensor packed_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv) {
  return format_row(w).gemm_silu(std::move(x), w, kv);
}

// The C++ names of the formats in WeightFormat's order (formats.py checks its rows against them).
inline std::vector<std::string> weight_formats() {
  std::vector<std::string> names;
  for (const FormatRow& row : kFormats) names.emplace_back(row.name);
  return names;
}
