// The decoder layers in one call from Python, every kernel on the whole OpenMP
// team (layer_loop: plan.py's layer loop itself, for any step; no Python
// between the ~270 kernel calls of a step), and run_layers, the loop that the
// split stack (layer_stack.cpp) runs on each thread's own rows.
//
// Two threads do not overlap attention (memory) with projections (compute) by
// themselves: the attention kernel is bound by each core's own misses in
// flight, not by the memory bus. Instead each thread's projections ask for
// the next layer's K/V of its queries (kv_prefetch.h), where a layer's K/V
// fits the L3 and a thread has at most 48 rows (cpu_features.cpp says where).
#include <torch/extension.h>

#include "cpu_features.h"
#include "distributed.h"
#include "kv_prefetch.h"
#include "layer_loop.h"
#include "layer_stack.h"
#include "no_gil.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include <omp.h>

at::Tensor paged_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor seq_lens,
                        double scale, int64_t sliding_window, at::Tensor seq_ids, bool prefill_tiles,
                        double logit_softcap, const std::optional<at::Tensor>& sinks);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rope_qkv_cache(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                    at::Tensor slot_mapping, at::Tensor q_norm, at::Tensor k_norm, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up);

void check_stack(const ModelWeights& s, const std::vector<at::Tensor>& kv_caches, const at::Tensor& hidden,
                 const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& tables,
                 const at::Tensor& seq_lens, const at::Tensor& seq_ids, const std::vector<int64_t>& layer_groups) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0 && s.layers.size() == layers, "layer_stack: a KV cache per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "layer_stack: hidden [n, hidden] contiguous");
  const int64_t n = hidden.size(0);
  TORCH_CHECK(slot_mapping.dim() == 2 && tables.dim() == 3 && slot_mapping.size(0) == tables.size(0),
              "layer_stack: slot_mapping [groups, n] and tables [groups, sequences, blocks]");
  TORCH_CHECK(positions.numel() == n && slot_mapping.size(1) == n && seq_lens.numel() == n,
              "layer_stack: a position, a slot and a seq_len per row");
  TORCH_CHECK(seq_ids.numel() == 0 || seq_ids.numel() == n, "layer_stack: seq_ids per row or empty");
  TORCH_CHECK(layer_groups.empty() || layer_groups.size() == layers, "layer_stack: a KV group per layer or none");
  for (const int64_t g : layer_groups)
    TORCH_CHECK(g >= 0 && g < tables.size(0), "layer_stack: a layer's KV group out of range");
}

namespace {
// The stream of K/V rows paged_attention will read for these queries in this
// cache (int64 contiguous tables, lens, seq), in its order.
KvPrefetch kv_stream(const at::Tensor& cache, const at::Tensor& tab, const at::Tensor& lens, const at::Tensor& seq,
                     int64_t window) {
  KvPrefetch p;
  const int64_t es = cache.element_size();
  p.k = static_cast<const char*>(cache.data_ptr());
  p.v_off = cache.stride(0) * es;
  p.table = tab.data_ptr<int64_t>();
  p.max_blocks = tab.size(1);
  p.lens = lens.data_ptr<int64_t>();
  p.seq = seq.numel() ? seq.data_ptr<int64_t>() : nullptr;
  p.window = window;
  p.block_size = cache.size(2);
  p.block_bytes = cache.stride(1) * es;
  p.row_bytes = cache.stride(2) * es;
  p.q_end = lens.numel();
  return p;
}

// The MLP's act(gate) * up from gate_up's output (the model's activation).
at::Tensor act_and_mul(const ModelWeights& s, const at::Tensor& gate_up) {
  return s.act == MlpAct::kGeluTanh ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
}

// o_proj / down_proj: packed_gemm, or on a shard (tp) its float32 partial sum
// all-reduced over the ranks and rounded once (as the whole GEMM rounds its sum).
at::Tensor row_parallel(const at::Tensor& x, const PackedWeight& w, const ShmGroup* tp, const KvStreams& kv) {
  if (!tp) return packed_gemm(x, w, false, kv);
  at::Tensor sum = packed_gemm(x, w, true, kv);
  shm_reduce(*tp, sum);
  return sum.to(x.scalar_type());
}

}  // namespace

// Rows h through every layer (layer_loop.h says how).
at::Tensor run_layers(const ModelWeights& s, const std::vector<at::Tensor>& kv_caches, at::Tensor h,
                      const at::Tensor& pos, const at::Tensor& slots, at::Tensor lens, at::Tensor seq,
                      const at::Tensor& tab, const std::vector<int64_t>& layer_groups, const at::Tensor* out_rows,
                      Prefetch prefetch, const ShmGroup* tp, const LoraStep* lora) {
  TORCH_CHECK(!lora || (!out_rows && !tp), "layer_loop: LoRA rows run with every row, unsharded");
  for (const LayerWeights& w : s.layers)
    TORCH_CHECK(!w.moe.has_experts() || (!lora && !tp), "layer_loop: a sparse MLP runs without LoRA, unsharded");
  const size_t layers = kv_caches.size();
  const int64_t q_size = s.num_heads * s.head_dim;
  int64_t m = h.size(0);
  at::Tensor residual = h;
  at::Tensor pf_lens, pf_seq;  // paged_attention's arguments as the prefetch stream reads them
  std::vector<at::Tensor> pf_tab;  // (a table per KV group)
  auto group = [&](size_t layer) { return layer_groups.empty() ? int64_t{0} : layer_groups[layer]; };
  // The streams the projections after each attention feed (kv_prefetch.h):
  // kOwn one, this thread's (its GEMMs run on it alone); kTeam one for each
  // thread of the team the GEMMs run on. Passed to those GEMMs only.
  std::vector<KvPrefetch> streams(prefetch == Prefetch::kTeam ? omp_get_max_threads()
                                  : prefetch == Prefetch::kOwn ? 1
                                                               : 0);
  if (prefetch != Prefetch::kNone) {
    pf_lens = lens.to(at::kLong).contiguous();
    for (int64_t g = 0; g < tab.size(0); ++g) pf_tab.push_back(tab.select(0, g).to(at::kLong).contiguous());
    pf_seq = seq.numel() ? seq.to(at::kLong).contiguous() : seq;
  }
  for (size_t i = 0; i < layers; ++i) {
    const LayerWeights& w = s.layers[i];
    at::Tensor x;
    if (i == 0) {
      x = rms_norm(h, w.norm1, s.eps);
    } else {
      fused_add_rms_norm(h, residual, w.norm1, s.eps);
      x = h;
    }
    // (the streams are filled after attention; the delta comes before RoPE and the cache write)
    at::Tensor qkv = lora ? lora_gemm(x, w.qkv, KvStreams{}, *lora, i, kLoraQkv)
                          : packed_gemm(x, w.qkv, false, KvStreams{});
    const bool own_rope = w.cos.defined() && w.cos.numel();  // (Gemma 3's sliding layers)
    rope_qkv_cache(qkv, s.num_heads, s.num_kv_heads, s.head_dim, pos, own_rope ? w.cos : s.cos,
                   own_rope ? w.sin : s.sin, kv_caches[i], slots.select(0, group(i)), w.q_norm, w.k_norm, s.eps);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({m, s.num_heads, s.head_dim});
    if (out_rows && i + 1 == layers) {  // every K/V is written: the rest for the rows out
      q = q.index_select(0, *out_rows);
      residual = residual.index_select(0, *out_rows);
      lens = lens.index_select(0, *out_rows);
      seq = seq.numel() ? seq.index_select(0, *out_rows) : *out_rows;
      m = out_rows->numel();
    }
    at::Tensor out = paged_attention(q, kv_caches[i], tab.select(0, group(i)), lens, w.scale, w.sliding_window, seq,
                                     s.prefill_tiles, w.logit_softcap,
                                     w.sinks.numel() ? std::optional<at::Tensor>(w.sinks) : std::nullopt);
    // The next layer's K/V rows, fed by the GEMM tiles below until the end of this layer.
    const bool pf = prefetch != Prefetch::kNone && i + 1 < layers && !(out_rows && i + 2 == layers);
    KvStreams kv;
    if (pf) {
      const KvPrefetch next_kv = kv_stream(kv_caches[i + 1], pf_tab[group(i + 1)], pf_lens, pf_seq,
                                           s.layers[i + 1].sliding_window);
      const int64_t nth = static_cast<int64_t>(streams.size());
      for (int64_t t = 0; t < nth; ++t) {
        KvPrefetch& p = streams[t] = next_kv;
        // kTeam: each thread the queries its part of the kernel takes
        if (prefetch == Prefetch::kTeam) query_range(next_kv.lens, next_kv.q_end, next_kv.window, t, nth, p.q, p.q_end);
      }
      kv = KvStreams{streams.data(), nth};
    }
    const at::Tensor attn = out.view({m, q_size});
    h = lora ? lora_gemm(attn, w.o, kv, *lora, i, kLoraO) : row_parallel(attn, w.o, tp, kv);
    if (w.attn_out_norm.numel()) h = rms_norm(h, w.attn_out_norm, s.eps);  // (Gemma: before the residual add)
    fused_add_rms_norm(h, residual, w.norm2, s.eps);
    if (w.moe.has_experts()) {  // the sparse MLP: its experts' GEMMs feed the streams as the dense ones do
      h = moe_mlp(h, w.moe, kv);
      continue;
    }
    at::Tensor act;
    if (lora) {  // (the activation apart from the GEMM, so the delta joins gate/up before it)
      act = act_and_mul(s, lora_gemm(h, w.gate_up, kv, *lora, i, kLoraGateUp));
    } else {
      // gate/up on whole blocks of 16: silu(gate) * up from the GEMM's tiles (SiLU only).
      const bool fused_silu = s.act == MlpAct::kSilu && w.gate_up.n % 32 == 0;
      act = fused_silu ? packed_gemm_silu(h, w.gate_up, kv) : act_and_mul(s, packed_gemm(h, w.gate_up, false, kv));
    }
    h = lora ? lora_gemm(act, w.down, kv, *lora, i, kLoraDown) : row_parallel(act, w.down, tp, kv);
    if (w.mlp_out_norm.numel()) h = rms_norm(h, w.mlp_out_norm, s.eps);  // (Gemma: before the residual add)
  }
  fused_add_rms_norm(h, residual, s.final_norm, s.eps);
  return h;
}

// The layer loop of plan.py in one call (no Python between the ~270
// kernel calls of a step), every kernel on the whole OpenMP
// team, in the same order: the same bits. For any step: every row's K/V of a
// layer is written before any row of it attends, as a prefill that hits the
// prefix cache on a block written in the same step needs. output_rows: the
// rows to return (all of them when all_rows).
namespace {
at::Tensor layer_loop_impl(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                           std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                           at::Tensor seq_lens, at::Tensor seq_ids, const std::vector<int64_t>& layer_groups,
                           at::Tensor output_rows, bool all_rows, KvPrefetchMode kv_prefetch, const ShmGroup* tp,
                           const LoraStep* lora = nullptr) {
  NoGil no_gil;
  const ModelWeights& s = model;
  const int64_t head_dim = s.head_dim;
  check_stack(s, kv_caches, hidden, positions, slot_mapping, tables, seq_lens, seq_ids, layer_groups);
  if (!all_rows) output_rows = output_rows.to(at::kLong).contiguous();
  // The K/V prefetch (kv_prefetch.h) as in layer_stack's split steps, each
  // thread for the queries its part of the bf16 attention kernel takes: for
  // decode-only steps (no two queries of one request) of 8 to kPrefetchMaxRows
  // rows, where kv_prefetch (the plan's option) allows it. (Not with dynamic
  // teams: a GEMM's smaller team would leave the streams of its missing
  // threads' queries unfed.) Not in float32 on AVX2, where it cost
  // (docs/perf-notes.md).
  const bool bf16_kernel = avx512_bf16(hidden) &&  // (its split is query_range's)
                           (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256);
  bool prefetch = !omp_get_dynamic() && bf16_kernel && kv_prefetch_on(kv_prefetch) &&
                  hidden.size(0) >= kTeamPrefetchMinRows && hidden.size(0) <= kPrefetchMaxRows &&
                  kv_fits_l3(kv_caches, s.layers, seq_lens);
  if (prefetch && seq_ids.numel()) {
    const at::Tensor r = seq_ids.to(at::kLong).contiguous();
    const int64_t* q = r.data_ptr<int64_t>();
    for (int64_t i = 1; i < r.numel() && prefetch; ++i) prefetch = q[i] != q[i - 1];
  }
  return run_layers(s, kv_caches, hidden, positions, slot_mapping, seq_lens, seq_ids, tables, layer_groups,
                    all_rows ? nullptr : &output_rows, prefetch ? Prefetch::kTeam : Prefetch::kNone, tp, lora);
}
}  // namespace

at::Tensor layer_loop(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                      std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                      at::Tensor seq_lens, at::Tensor seq_ids, std::vector<int64_t> layer_groups,
                      at::Tensor output_rows, bool all_rows,
                      int64_t kv_prefetch, std::vector<const LoraAdapterWeights*> lora_adapters,
                      std::vector<at::Tensor> lora_rows) {
  TORCH_CHECK(lora_adapters.empty() || all_rows, "layer_loop: LoRA steps return every row");
  const LoraStep step = lora_step(std::move(lora_adapters), std::move(lora_rows), kv_caches.size(), hidden.size(0));
  return layer_loop_impl(model, hidden, positions, std::move(kv_caches), slot_mapping, tables, seq_lens,
                         seq_ids, layer_groups, output_rows, all_rows, kv_prefetch_mode(kv_prefetch), nullptr,
                         step.adapters.empty() ? nullptr : &step);
}

// layer_loop on a tensor-parallel shard whose ranks share this machine: the
// all-reduce after each o_proj and down_proj over `group`'s shared memory,
// inside the loop (no Python between the kernels of a step).
at::Tensor layer_loop_tp(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                         std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                         at::Tensor seq_lens, at::Tensor seq_ids, std::vector<int64_t> layer_groups,
                         at::Tensor output_rows, bool all_rows, const ShmGroup& group, int64_t kv_prefetch) {
  check_group(group);
  return layer_loop_impl(model, hidden, positions, std::move(kv_caches), slot_mapping, tables, seq_lens,
                         seq_ids, layer_groups, output_rows, all_rows, kv_prefetch_mode(kv_prefetch), &group);
}

// The cache slots (block * block_size + offset) of the K rows that the
// prefetch stream of kv_prefetch.h visits, in order: for tests, which check
// them against the rows the attention kernel reads.
at::Tensor kv_prefetch_rows(at::Tensor kv_cache, at::Tensor tables, at::Tensor seq_lens, at::Tensor seq_ids,
                            int64_t window) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache [2, blocks, block_size, kv_heads, head_dim]");
  tables = tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  seq_ids = seq_ids.to(at::kLong).contiguous();
  KvPrefetch p = kv_stream(kv_cache, tables, seq_lens, seq_ids, window);
  std::vector<int64_t> slots;
  while (p.q < p.q_end) slots.push_back((p.take_row() - p.k) / p.row_bytes);
  return at::tensor(slots, at::kLong);
}

