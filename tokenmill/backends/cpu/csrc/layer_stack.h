// The weights the decoder-layer calls (layer_loop.cpp, layer_stack.cpp) take, by name: one
// LayerWeights per layer and one ModelWeights for the stack, built once by
// the CPU plan (plan.py) and bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

#include "formats.h"

#include <cstdint>
#include <vector>

struct LayerWeights {
  at::Tensor norm1;      // input_layernorm weight [hidden]
  PackedWeight qkv;      // qkv_proj (formats.h: any format, with its bias)
  PackedWeight o;        // o_proj
  at::Tensor norm2;      // post_attention_layernorm weight [hidden]
  PackedWeight gate_up;  // gate_up_proj ([gate; up] rows, no bias)
  PackedWeight down;     // down_proj
  at::Tensor q_norm, k_norm;  // per-head RMSNorm weights [head_dim] before RoPE (Qwen3); empty: none
  int64_t sliding_window = 0;  // 0: none
  double scale = 1.0;          // the attention scale
};

struct ModelWeights {
  std::vector<LayerWeights> layers;
  at::Tensor final_norm;  // the model's last norm weight [hidden]
  double eps = 1e-6;      // every norm's epsilon
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  at::Tensor cos, sin;  // the rotary tables [max_positions, head_dim / 2]
  bool prefill_tiles = false;  // paged_attention's opt-out of batch invariance (paged_attention.cpp)
};

// One LoRA adapter (model/lora.py's LoRAAdapter) as layer_loop takes it: for
// layer L and fused projection P (LoraProjectionIndex), projections[L * 4 + P]
// holds its stacked A transposed [in, R], block-diagonal B transposed [R, out]
// and per-rank scale [R], float32; an undefined A: that projection is not
// adapted. Built once per adapter by the CPU plan.
enum LoraProjectionIndex : int { kLoraQkv = 0, kLoraO = 1, kLoraGateUp = 2, kLoraDown = 3, kLoraProjections = 4 };

struct LoraProjection {
  at::Tensor a, b, scale;
};

struct LoraAdapterWeights {
  std::vector<LoraProjection> projections;
};

// A step's adapters and each one's rows of the step (int64 indices).
struct LoraStep {
  std::vector<const LoraAdapterWeights*> adapters;
  std::vector<at::Tensor> rows;
};
