// A mixture-of-experts MLP's weights and its one op (moe.cpp): what the layer
// calls (layer_loop.cpp) and the Python binding share.
#pragma once

#include <torch/extension.h>

#include "formats.h"
#include "kv_prefetch.h"

#include <cstdint>
#include <vector>

// A sparse MLP (Qwen3-MoE, Mixtral, gpt-oss): the router [experts, hidden] and
// each expert's gate_up ([gate; up] rows) and down, any formats (formats.h),
// with their biases where the checkpoint has them (gpt-oss). No experts: the
// layer's MLP is dense.
struct MoeWeights {
  PackedWeight router;
  std::vector<PackedWeight> gate_up, down;
  int64_t top_k = 0;
  bool norm_topk_prob = false;  // the chosen experts' weights renormalised to sum to 1
  // gpt-oss: the top k logits softmaxed in the dtype (not the top k of the softmax), and
  // the clamped SwiGLU (up + 1) * g * sigmoid(alpha g), g = min(gate, limit), up in
  // [-limit, limit]; swiglu_limit 0: silu(gate) * up.
  bool topk_then_softmax = false;
  double swiglu_limit = 0.0, swiglu_alpha = 1.702;
  bool has_experts() const { return !gate_up.empty(); }
};

// Throws unless `w` is a router and experts over `hidden` inputs (shapes, top_k).
void check_moe(const MoeWeights& w, int64_t hidden);

// x [T, hidden] bf16 or float32 -> [T, hidden] in x's dtype: each row through its
// top_k experts (moe.cpp says how, and in which order the results are summed).
// kv: the K/V prefetch streams its GEMMs feed (formats.h GemmFn; none from Python).
at::Tensor moe_mlp(const at::Tensor& x, const MoeWeights& w, const KvStreams& kv);
