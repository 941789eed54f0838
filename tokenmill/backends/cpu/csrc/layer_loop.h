// The decoder layers in one C++ call (layer_loop.cpp): what the layer loop
// and the split stack (layer_stack.cpp) share.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "distributed.h"
#include "layer_stack.h"

// Rows h (changed in place) through every layer and the final norm, each
// kernel with the OpenMP team it gets; `seq` empty: query i reads table row i.
// `slots` [groups, n] and `tab` [groups, sequences, blocks]: each KV layer
// group's (core/kv_layout.py); layer i uses group layer_groups[i] (empty: 0).
// With `out_rows`, the last layer runs on past its K/V write for those rows
// only (the result has one row each), as plan.py does. With a
// prefetch mode, the projections after each layer's attention ask for the
// next layer's K/V rows of these queries (kv_prefetch.h): kOwn, all of them
// (this thread runs every kernel alone, in layer_stack); kTeam, each thread of
// the OpenMP team the rows its part of the attention kernel will read.
enum class Prefetch { kNone, kOwn, kTeam };

// With `tp` (a tensor-parallel shard's group), o_proj and down_proj are
// row-parallel: their float32 sums are all-reduced, then rounded once. With
// `lora` (never with out_rows or tp), each projection's output gets the step's
// adapters' deltas (lora_delta) before it goes on.
at::Tensor run_layers(const ModelWeights& s, const std::vector<at::Tensor>& kv_caches, at::Tensor h,
                      const at::Tensor& pos, const at::Tensor& slots, at::Tensor lens, at::Tensor seq,
                      const at::Tensor& tab, const std::vector<int64_t>& layer_groups, const at::Tensor* out_rows,
                      Prefetch prefetch = Prefetch::kNone, const ShmGroup* tp = nullptr,
                      const LoraStep* lora = nullptr);

// Throws unless the stack's arguments have a K/V cache per layer and a position,
// slot and seq_len per row.
void check_stack(const ModelWeights& s, const std::vector<at::Tensor>& kv_caches, const at::Tensor& hidden,
                 const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& tables,
                 const at::Tensor& seq_lens, const at::Tensor& seq_ids, const std::vector<int64_t>& layer_groups);
