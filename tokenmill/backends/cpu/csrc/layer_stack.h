// The weights the decoder-layer calls (layer_loop.cpp, layer_stack.cpp) take, by name: one
// LayerWeights per layer and one ModelWeights for the stack, built once by
// the CPU plan (plan.py) and bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

struct LayerWeights {
  at::Tensor norm1;     // input_layernorm weight [hidden]
  at::Tensor qkv;       // packed qkv_proj (memory.pack_weight)
  at::Tensor qkv_bias;  // [qkv_n] or empty
  at::Tensor o;         // packed o_proj
  at::Tensor o_bias;    // [o_n] or empty
  at::Tensor norm2;     // post_attention_layernorm weight [hidden]
  at::Tensor gate_up;   // packed gate_up_proj ([gate; up] rows)
  at::Tensor down;      // packed down_proj
  int64_t qkv_n = 0, o_n = 0, gate_up_n = 0, down_n = 0;  // each projection's output features
  int64_t sliding_window = 0;                             // 0: none
  double scale = 1.0;                                     // the attention scale
};

struct ModelWeights {
  std::vector<LayerWeights> layers;
  at::Tensor final_norm;  // the model's last norm weight [hidden]
  double eps = 1e-6;      // every norm's epsilon
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  at::Tensor cos, sin;  // the rotary tables [max_positions, head_dim / 2]
};
