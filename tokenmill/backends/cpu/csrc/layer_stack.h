// The weights the decoder-layer calls (layer_loop.cpp, layer_stack.cpp) take, by name: one
// LayerWeights per layer and one ModelWeights for the stack, built once by
// the CPU plan (plan.py) and bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

#include "formats.h"
#include "moe.h"

#include <cstdint>
#include <vector>

// Every norm weight is in the model's dtype, or float32 for Gemma's (1 + w)
// norms, which scale in float32 (fused_ops.cpp rms_norm).
struct LayerWeights {
  at::Tensor norm1;      // input_layernorm weight [hidden]
  PackedWeight qkv;      // qkv_proj (formats.h: any format, with its bias)
  PackedWeight o;        // o_proj
  at::Tensor norm2;      // the norm fused with the residual add before the MLP [hidden]
                         // (post_attention_layernorm; Gemma's pre_feedforward_layernorm)
  PackedWeight gate_up;  // gate_up_proj ([gate; up] rows, no bias); a sparse MLP: none
  PackedWeight down;     // down_proj; a sparse MLP: none
  MoeWeights moe;        // a sparse MLP's router and experts (moe.h); none: the dense MLP above
  at::Tensor q_norm, k_norm;  // per-head RMSNorm weights [head_dim] before RoPE (Qwen3, Gemma 3); empty: none
  int64_t sliding_window = 0;  // 0: none
  double scale = 1.0;          // the attention scale
  // Gemma's sandwich norms: on the attention's output (HF's post_attention_layernorm)
  // and on the MLP's (post_feedforward_layernorm), before each joins the residual; empty: none.
  at::Tensor attn_out_norm, mlp_out_norm;
  at::Tensor cos, sin;          // this layer's own rotary tables (Gemma 3's sliding layers); empty: the model's
  double logit_softcap = 0.0;   // attention scores' soft-cap (Gemma 2); 0: none
  at::Tensor sinks;             // attention sinks [num_heads] float32 (gpt-oss); empty: none
};

enum class MlpAct : int64_t { kSilu = 0, kGeluTanh = 1 };  // the MLP's act(gate) * up

struct ModelWeights {
  std::vector<LayerWeights> layers;
  at::Tensor final_norm;  // the model's last norm weight [hidden]
  double eps = 1e-6;      // every norm's epsilon
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  at::Tensor cos, sin;  // the rotary tables [max_positions, head_dim / 2]
  bool prefill_tiles = false;  // paged_attention's opt-out of batch invariance (paged_attention.cpp)
  MlpAct act = MlpAct::kSilu;  // SwiGLU, or GeGLU (Gemma)
};

// One LoRA adapter (model/lora.py's LoRAAdapter) as layer_loop takes it: for
// layer L and fused projection P (LoraProjectionIndex), projections[L * 4 + P];
// an undefined `a`: that projection is not adapted. Built once per adapter by
// the CPU plan (pack_lora_projection), in the model's dtype (float32 or bf16:
// vLLM's lora_dtype "auto"), packed for lora_delta's tiles:
// - a: every part's A stacked, transposed, in panels of kLoraRanks ranks
//   ([ceil(R / 16)][in][16], zero-padded), so a tile reads its panel in order;
// - b: each part's own B (no block-diagonal zeros), transposed, in panels of
//   kLoraOuts outputs ([chunks][rank][64], zero-padded), at parts[i].offset;
// - scale [R] float32 (padded to the panels with zeros).
enum LoraProjectionIndex : int { kLoraQkv = 0, kLoraO = 1, kLoraGateUp = 2, kLoraDown = 3, kLoraProjections = 4 };
constexpr int64_t kLoraRanks = 16, kLoraOuts = 64;

struct LoraPart {
  int64_t out_lo, out_hi, rank_lo, rank_hi, offset;  // its outputs, its ranks, its B panels in b
};

struct LoraProjection {
  at::Tensor a, b, scale;
  std::vector<LoraPart> parts;
  int64_t in = 0, rank = 0, out = 0;  // rank: R, the parts' ranks together
};

// A [R, in], block-diagonal B [out, R], scale [R] (float32) and parts [P, 4]
// int64 (out_lo, out_hi, rank_lo, rank_hi) packed as above in `dtype`.
LoraProjection pack_lora_projection(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale,
                                    const at::Tensor& parts, at::ScalarType dtype);

struct LoraAdapterWeights {
  std::vector<LoraProjection> projections;
};

// A step's adapters and each one's rows of the step (int64 indices).
struct LoraStep {
  std::vector<const LoraAdapterWeights*> adapters;
  std::vector<at::Tensor> rows;
};

// The step's adapters checked against `layers` layers and `num_rows` rows.
LoraStep lora_step(std::vector<const LoraAdapterWeights*> adapters, std::vector<at::Tensor> rows, size_t layers,
                   int64_t num_rows);
// packed_gemm(x, w) plus each adapter's delta of x [n, I] on its rows, for one
// layer's projection, the delta in the GEMM's own region (formats.h GemmSide; lora_delta.cpp).
at::Tensor lora_gemm(const at::Tensor& x, const PackedWeight& w, const KvStreams& kv, const LoraStep& lora,
                     size_t layer, int projection);
