// y = x W^T (+ bias) on a weight whose output rows are parts of different formats
// (formats.py PARTS: a Q4_K_M file's fused qkv, Q4_K q and k beside a Q6_K v): each
// part's GEMM in its own format, its columns of y in order. A column is its part's
// GEMM's output, so its bits are too (and the same at every row count, as the part's).
#include <torch/extension.h>

#include "formats.h"

#include <vector>

at::Tensor silu_and_mul(at::Tensor gate_up);  // (fused_ops.cpp)

at::Tensor parts_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                      const GemmSide* side) {
  TORCH_CHECK(!w.parts.empty(), "parts GEMM: a weight of no parts (pack it with formats.pack)");
  std::vector<at::Tensor> ys;
  ys.reserve(w.parts.size());
  for (const PackedWeight& part : w.parts) ys.push_back(packed_gemm(x, part, float32_out, kv));
  at::Tensor y = at::cat(ys, 1);
  if (side) side->alone(y);  // (y is whole only here)
  return y;
}

at::Tensor parts_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv) {
  return silu_and_mul(parts_gemm(std::move(x), w, false, kv, nullptr));
}
