// The split stack. layer_stack: the decoder layers with the
// step's rows split between the threads: each thread takes its own rows (whole
// requests) through every layer alone, on the same kernels, single-threaded (an
// OpenMP region nested in this one gets one thread). What it saves: the fork
// and barrier of each of the ~270 OpenMP regions of a step (9 a layer), the
// threads' uneven shares of each small op, and the Python between the ops. Not
// a win below ~16 rows a thread in bf16, ~32 in float32: each thread then reads
// all the weights for itself (plan.SPLIT_ROWS_PER_WEIGHT_BYTE).
// plan.split_bounds sends only decode-only steps here: a prefill may
// read K/V that another request writes in the same step (a prefix-cache hit),
// which needs every thread's writes of a layer before any thread's attention,
// as the layer loop has them.
//
// Every row's result is the same bits as through the layer loop: each kernel
// computes a row (a query, a token) the same way whatever rows are around it
// (tests/test_model_numerics.py: test_split_layer_stack_gives_the_same_bits).
//
//   model       the weights and shape, by name (layer_stack.h)
//   hidden      [n, hidden] the embeddings (changed in place, as plan.py does)
//   kv_caches   one per layer; slot_mapping [groups, n]: each row's cache slot
//   tables [groups, ...], seq_lens, seq_ids: paged_attention's arguments for all n queries
//   layer_groups each layer's KV group (core/kv_layout.py; empty: all group 0)
//   bounds      [0, r1, ..., n]: thread t takes rows [bounds[t], bounds[t+1]),
//               each a run of whole requests
//   kv_prefetch the K/V prefetch's mode (cpu_features.h KvPrefetchMode)
//   lora_adapters, lora_rows: the step's LoRA adapters and each one's rows
//               (as layer_loop takes them; empty: none); each thread adds the
//               deltas of its own rows
#include <torch/extension.h>

#include "cpu_features.h"
#include "layer_loop.h"
#include "layer_stack.h"
#include "no_gil.h"
#include "team.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

at::Tensor layer_stack(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                       std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                       at::Tensor seq_lens, at::Tensor seq_ids, std::vector<int64_t> layer_groups,
                       std::vector<int64_t> bounds, int64_t kv_prefetch,
                       std::vector<const LoraAdapterWeights*> lora_adapters, std::vector<at::Tensor> lora_rows) {
  // A whole forward (up to ~150 ms) without Python: let the server's other
  // threads (HTTP, streaming) run meanwhile. Re-taken on the way out.
  NoGil no_gil;
  const ModelWeights& s = model;
  check_stack(s, kv_caches, hidden, positions, slot_mapping, tables, seq_lens, seq_ids, layer_groups);
  const int64_t n = hidden.size(0);
  TORCH_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == n &&
                  std::is_sorted(bounds.begin(), bounds.end()),
              "layer_stack: bounds [0, ..., n], ascending");
  const bool per_query_row = seq_ids.numel() == 0;  // query i reads block table row i
  // The next layer's K/V asked for during each layer's projections
  // (kv_prefetch.h) where a layer's K/V (all threads') fits 3/4 of L3 and a
  // thread has at most kPrefetchMaxRows rows, in bf16 where kv_prefetch (the
  // plan's option) allows it (kv_prefetch_on; float32 goes without:
  // docs/perf-notes.md).
  const KvPrefetchMode mode = kv_prefetch_mode(kv_prefetch);
  const bool prefetch_kv = avx512_bf16(hidden) && kv_prefetch_on(mode) && kv_fits_l3(kv_caches, s.layers, seq_lens);
  at::Tensor result = at::empty_like(hidden);
  const int threads = static_cast<int>(bounds.size() - 1);
  // Each thread's share of the step's LoRA rows, as indices into its own rows.
  std::vector<LoraStep> lora(lora_adapters.empty() ? 0 : threads);
  if (!lora.empty()) {
    const LoraStep step = lora_step(std::move(lora_adapters), std::move(lora_rows), kv_caches.size(), n);
    for (int t = 0; t < threads; ++t) {
      for (size_t g = 0; g < step.adapters.size(); ++g) {
        const at::Tensor& r = step.rows[g];
        const at::Tensor mine = r.masked_select((r >= bounds[t]) & (r < bounds[t + 1])) - bounds[t];
        if (mine.numel() == 0) continue;
        lora[t].adapters.push_back(step.adapters[g]);
        lora[t].rows.push_back(mine.contiguous());
      }
    }
  }
  on_each_thread(threads, [&](int t) {  // the kernels' own regions run on this thread alone
    const int64_t r0 = bounds[t], m = bounds[t + 1] - r0;
    if (m > 0) {
      const at::Tensor seq = per_query_row ? seq_ids : seq_ids.narrow(0, r0, m);
      const at::Tensor tab = per_query_row ? tables.narrow(1, r0, m) : tables;
      result.narrow(0, r0, m).copy_(run_layers(s, kv_caches, hidden.narrow(0, r0, m), positions.narrow(0, r0, m),
                                               slot_mapping.narrow(1, r0, m), seq_lens.narrow(0, r0, m),
                                               seq, tab, layer_groups, nullptr,
                                               prefetch_kv && m <= kPrefetchMaxRows ? Prefetch::kOwn
                                                                                    : Prefetch::kNone,
                                               nullptr, lora.empty() || lora[t].adapters.empty() ? nullptr : &lora[t]));
    }
  });
  return result;
}
