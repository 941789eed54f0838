// The mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss) in one op: the router, the
// top-k choice, and each chosen expert's SwiGLU MLP as a grouped GEMM over the
// rows routed to it, in any weight format (formats.h: every GEMM goes through
// packed_gemm / packed_gemm_silu, so no format has code here).
//
//   logits = x R^T                        packed_gemm, in x's dtype (F.linear rounds there)
//   probs  = softmax(float32(logits))     torch's own kernels for these three (at::softmax,
//   w, ids = topk(probs, top_k)           at::topk, at::sum): transformers' bits, ties
//   w     /= sum(w) where norm_topk_prob  included
//   w      = w in x's dtype
//   for each expert e that any row chose, in increasing e:
//     rows  = the rows that chose e (a counting sort by expert: one pass, token order)
//     y     = down_e(silu(gate_e(x[rows])) * up_e(x[rows]))   two GEMMs on a gathered buffer
//     out[rows] = round(out[rows] + round(y * w[rows, e]))   in x's dtype
//
// The last line is transformers' index_add in the model's dtype (Qwen3MoeExperts,
// MixtralExperts): a row's experts summed in increasing id, rounding after each
// multiply and each add, so bf16 gives its bits wherever each expert's GEMM
// does. torch.topk breaks ties by its sort, not by expert id, and bf16 logits
// tie often (8 bits of mantissa over a hundred experts): its kernel here picks
// the experts the reference picks. Every step computes a row alone (the GEMMs
// sum each row alone at any row count; softmax, topk and the sum are per row):
// a row's result does not depend on which other rows share the step or an expert.
//
// Where at least two experts a thread were hit, they run side by side: each
// thread its share of the experts (greedy by rows, the largest first), each
// expert's GEMMs on that thread alone, then the sums in increasing expert id as
// above. A GEMM gives the same bits on any number of threads (it splits by
// outputs), so the choice moves no bit; it saves each expert's two team
// wake-ups, at decode the most of an expert's time (a row's GEMM is a few
// microseconds of weight reads). Otherwise (fewer experts hit, or inside the
// split stack's team of one) experts run one after the other, each GEMM on the
// whole team: one expert's rows are one GEMM call.
#include <torch/extension.h>

#include "formats.h"
#include "moe.h"
#include "no_gil.h"
#include "team.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include <omp.h>

at::Tensor silu_and_mul(at::Tensor gate_up);  // (fused_ops.cpp)

namespace moe_detail {

// Elementwise work is split over the team only from this many values (as fused_ops.cpp's).
constexpr int64_t kParallelValues = 16384;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// To the storage type, nearest even for bf16 (torch's rounding; a NaN stays a NaN).
template <typename T> inline T narrow(float v);
template <> inline float narrow<float>(float v) { return v; }
template <> inline at::BFloat16 narrow<at::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  at::BFloat16 r;
  r.x = static_cast<uint16_t>(v != v ? 0x7fc0u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return r;
}

// out[rows[i]] = round(out[rows[i]] + round(y[i] * w[rows[i], slots[i]])), i < n: one expert's
// rows (each a different token) into the sum, in out's dtype T.
template <typename T>
void combine(T* out, const T* y, const T* w, const int64_t* rows, const int64_t* slots, int64_t n, int64_t H,
             int64_t top_k) {
#pragma omp parallel for if (n * H >= kParallelValues)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = rows[i];
    const float wv = widen(w[t * top_k + slots[i]]);
    T* o = out + t * H;
    const T* yi = y + i * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) o[h] = narrow<T>(widen(o[h]) + widen(narrow<T>(widen(yi[h]) * wv)));
  }
}

// silu(gate) * up of x's rows on a gate_up weight: from the GEMM's tiles where gate
// and up are whole blocks of 16 outputs (the same bits), as the dense MLP
// (layer_loop.cpp); gpt-oss's clamped form on torch's own elementwise kernels, in
// the reference's order (model/llama.py LlamaMLP: its bits).
at::Tensor swiglu(const at::Tensor& x, const PackedWeight& gate_up, const MoeWeights& w, const KvStreams& kv) {
  if (w.swiglu_limit > 0) {
    const at::Tensor gu = packed_gemm(x, gate_up, false, kv);
    const int64_t inter = gate_up.n / 2;
    const at::Tensor gate = gu.narrow(1, 0, inter).clamp_max(w.swiglu_limit);
    const at::Tensor up = gu.narrow(1, inter, inter).clamp(-w.swiglu_limit, w.swiglu_limit);
    return (up + 1) * (gate * at::sigmoid(gate * w.swiglu_alpha));
  }
  if (gate_up.n % 32 == 0 && !gate_up.bias.numel()) return packed_gemm_silu(x, gate_up, kv);
  return silu_and_mul(packed_gemm(x, gate_up, false, kv));
}

}  // namespace moe_detail

void check_moe(const MoeWeights& w, int64_t hidden) {
  const int64_t E = static_cast<int64_t>(w.gate_up.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(w.down.size()) == E, "moe_mlp: a gate_up and a down weight per expert");
  TORCH_CHECK(w.router.n == E && w.router.k == hidden, "moe_mlp: the router is [", E, " experts, ", hidden,
              "], got [", w.router.n, ", ", w.router.k, "]");
  TORCH_CHECK(w.top_k >= 1 && w.top_k <= E, "moe_mlp: top_k ", w.top_k, " of ", E, " experts");
  for (int64_t e = 0; e < E; ++e) {
    const PackedWeight &gu = w.gate_up[e], &dn = w.down[e];
    TORCH_CHECK(gu.k == hidden && gu.n % 2 == 0 && dn.k == gu.n / 2 && dn.n == hidden, "moe_mlp: expert ", e,
                "'s gate_up is [2 inter, ", hidden, "] and its down [", hidden, ", inter], got [", gu.n, ", ", gu.k,
                "] and [", dn.n, ", ", dn.k, "]");
  }
}

at::Tensor moe_mlp(const at::Tensor& x_in, const MoeWeights& w, const KvStreams& kv) {
  using namespace moe_detail;
  NoGil no_gil;
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "moe_mlp: x [T, hidden] on the CPU");
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x_in.scalar_type() == at::kFloat, "moe_mlp: x in bfloat16 or float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), E = static_cast<int64_t>(w.gate_up.size()), k = w.top_k;
  check_moe(w, H);
  at::Tensor out = at::zeros({T, H}, x.options());
  if (T == 0) return out;

  // The routing, on torch's own kernels (softmax, topk, sum: their bits, ties as torch.topk
  // breaks them) from the rounded logits; the weights in x's dtype.
  const at::Tensor logits = packed_gemm(x, w.router, false, KvStreams{});
  at::Tensor chosen, chosen_ids;
  if (w.topk_then_softmax) {  // gpt-oss: the top k logits, softmaxed in the dtype
    std::tie(chosen, chosen_ids) = at::topk(logits, k, -1, true, true);
    chosen = at::softmax(chosen, -1, chosen.scalar_type());
  } else {
    std::tie(chosen, chosen_ids) = at::topk(at::softmax(logits.to(at::kFloat), -1), k, -1, true, true);
    if (w.norm_topk_prob) chosen = chosen / chosen.sum(-1, true);
  }
  const at::Tensor weights = chosen.to(x.scalar_type()).contiguous();
  const at::Tensor id_tensor = chosen_ids.to(at::kLong).contiguous();
  const int64_t* ids = id_tensor.data_ptr<int64_t>();

  // Rows grouped by expert (a counting sort: each expert's rows in token order, with their slot).
  std::vector<int64_t> first(static_cast<size_t>(E + 1), 0), rows(static_cast<size_t>(T * k)),
      slots(static_cast<size_t>(T * k));
  for (int64_t i = 0; i < T * k; ++i) ++first[static_cast<size_t>(ids[i] + 1)];
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t pos = fill[ids[t * k + s]]++;
      rows[pos] = t;
      slots[pos] = s;
    }

  // Each expert hit: its rows gathered, its MLP.
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; ++e)
    if (first[e + 1] > first[e]) hit.push_back(e);
  std::vector<at::Tensor> ys(static_cast<size_t>(E));
  auto run_expert = [&](int64_t e, const KvStreams& streams) {
    const int64_t n = first[e + 1] - first[e];
    int64_t* r = rows.data() + first[e];
    const at::Tensor xe = n == T ? x : x.index_select(0, at::from_blob(r, {n}, at::kLong));  // (all: rows 0..T-1)
    ys[e] = packed_gemm(swiglu(xe, w.gate_up[e], w, streams), w.down[e], false, streams).contiguous();
  };
  const int threads = omp_get_max_threads();
  if (threads > 1 && static_cast<int64_t>(hit.size()) >= 2 * threads) {
    // Side by side: each thread its experts (the most rows first, to the least loaded thread).
    std::vector<int64_t> order(hit), load(static_cast<size_t>(threads), 0);
    std::vector<int> owner(static_cast<size_t>(E), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return first[a + 1] - first[a] > first[b + 1] - first[b];
    });
    for (int64_t e : order) {
      const auto t = std::min_element(load.begin(), load.end()) - load.begin();
      owner[e] = static_cast<int>(t);
      load[t] += first[e + 1] - first[e] + 16;  // (+16: an expert's weight reads, worth about 16 rows' sums)
    }
    on_each_thread(threads, [&](int t) {  // each GEMM's own region on this thread alone
      for (int64_t e : hit)
        if (owner[e] == t) run_expert(e, KvStreams{});  // (the K/V prefetch follows a team's GEMMs only)
    });
  } else {
    for (int64_t e : hit) run_expert(e, kv);
  }
  // Each expert's share added to its rows', in increasing id.
  for (int64_t e : hit) {
    const int64_t n = first[e + 1] - first[e];
    int64_t* r = rows.data() + first[e];
    const at::Tensor& ye = ys[e];
    if (bf16)
      combine(out.data_ptr<at::BFloat16>(), ye.data_ptr<at::BFloat16>(), weights.data_ptr<at::BFloat16>(), r,
              slots.data() + first[e], n, H, k);
    else
      combine(out.data_ptr<float>(), ye.data_ptr<float>(), weights.data_ptr<float>(), r, slots.data() + first[e],
              n, H, k);
  }
  return out;
}
