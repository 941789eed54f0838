// What this CPU is, for the policies that depend on it (cpu_features.cpp):
// which build's kernels a dtype runs on, whether the K/V prefetch of
// kv_prefetch.h pays here, and the L3's size.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "layer_stack.h"

// A thread's rows past which the K/V prefetch did not pay.
inline constexpr int64_t kPrefetchMaxRows = 48;
// Below this many rows the projections are bound by reading the weights, and
// the prefetch competes with them (the layer loop's team prefetch).
inline constexpr int64_t kTeamPrefetchMinRows = 8;

bool avx512_bf16(const at::Tensor& x);
bool kv_prefetch_pays();
bool kv_prefetch_on();
int64_t l3_bytes();
bool kv_fits_l3(const std::vector<at::Tensor>& kv_caches, const std::vector<LayerWeights>& layers,
                const at::Tensor& seq_lens);
int64_t kv_prefetch_mode(int64_t mode);
