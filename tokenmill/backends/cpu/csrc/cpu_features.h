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

// When the layer calls ask for the next layer's K/V during the projections:
// the plan's option (options.py CpuBackendOptions.kv_prefetch, passed to each
// layer call as its integer).
enum class KvPrefetchMode : int64_t {
  kAuto = -1,  // where kv_prefetch_pays (the default)
  kOff = 0,    // never
  kOn = 1,     // wherever it applies, on any CPU (tests, so that they run the prefetching code)
};

bool avx512_bf16(const at::Tensor& x);
bool kv_prefetch_pays();
// The mode of a layer call's kv_prefetch argument; throws on any other value.
KvPrefetchMode kv_prefetch_mode(int64_t mode);
bool kv_prefetch_on(KvPrefetchMode mode);
int64_t l3_bytes();
bool kv_fits_l3(const std::vector<at::Tensor>& kv_caches, const std::vector<LayerWeights>& layers,
                const at::Tensor& seq_lens);
