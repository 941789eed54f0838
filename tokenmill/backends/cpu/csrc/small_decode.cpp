// Decode steps of a few requests (interactive use: one chat, a few streams).
// There a step is bound by reading the weights once (~270 MB for the default
// model in bf16), and the layer loop's ~270 OpenMP regions of 20-70 us each
// lose time at every fork and barrier (a sleeping worker's wake-up under a
// short spin) and ramp each GEMM's weight stream up from cold. small_decode
// runs the whole decoder stack in one parallel region instead: every
// projection's output groups split between the threads (each weight read
// once a step, by one thread, at both cores' bandwidth), the small ops (norms,
// RoPE and the K/V write, attention) on the rows each thread owns, and a
// barrier of its own between the phases that spins briefly and then sleeps
// (a shared machine: never burn the slice the other thread needs).
//
// Every kernel computes a row (or an output) the same way whatever else is in
// the call, so the result is the same bits as layer_loop's
// (tests/test_cpu_kernels.py). Decode-only steps (one query row a request):
// a row reads only blocks of earlier steps and its own new slot, so the
// threads' attention need not wait for each other's K/V writes.
//
//   model, hidden [n, hidden] bf16 (changed in place), positions, kv_caches,
//   slot_mapping, tables, seq_lens, query_req: as layer_stack takes them
//   threads: the team (1: every kernel on one thread)
//   -> [n, hidden] after the final norm
#include <torch/extension.h>

#include "kv_prefetch.h"
#include "layer_stack.h"
#include "no_gil.h"

#include <atomic>
#include <cstdint>
#include <exception>
#include <vector>

#include <climits>

#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor seq_lens,
                        double scale, int64_t sliding_window, at::Tensor query_req);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rope_qkv_cache(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                    at::Tensor slot_mapping);
int64_t packed_gemm_groups(int64_t nblocks, bool silu);
bool packed_gemm_part_bf16();
void packed_gemm_part(const void* x, const void* packed, const float* bias32, void* y, int64_t M, int64_t K,
                      int64_t n_out, int64_t nblocks, bool silu, int64_t g0, int64_t g1);

namespace {

// Rounds a waiting thread spins (a pause each, ~20-40 ns on x86) before it
// sleeps on a futex until the last thread arrives: a phase of the step is
// 5-100 us, so on a quiet machine the wait ends while spinning, and where
// another job holds a core the waiter gives its core up. (Yielding the core
// at every round instead, sched_yield, was slower beside a busy process: the
// yielder loses its core to that process for a whole time slice, where a
// woken sleeper preempts it: docs/perf-notes.md.)
std::atomic<int64_t> g_spin_rounds{4000};

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    if (n_ == 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_seq_cst);  // (ordered before the sleepers_ read)
      if (sleepers_.load(std::memory_order_seq_cst) > 0)
        syscall(SYS_futex, reinterpret_cast<int*>(&gen_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
      return;
    }
    const int64_t spin = g_spin_rounds.load(std::memory_order_relaxed);
    for (int64_t i = 0; i < spin; ++i) {
      if (gen_.load(std::memory_order_acquire) != gen) return;
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (gen_.load(std::memory_order_seq_cst) == gen)  // (the kernel rechecks gen_ == gen before sleeping)
      syscall(SYS_futex, reinterpret_cast<int*>(&gen_), FUTEX_WAIT_PRIVATE, gen, nullptr, nullptr, 0);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

 private:
  const int n_;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
  alignas(64) std::atomic<int> sleepers_{0};
};

// A projection for packed_gemm_part: its packed weights and (padded float32) bias.
struct Proj {
  const void* w;
  int64_t n, nblocks, groups;
  at::Tensor bias32;  // undefined: none
};

Proj proj(const at::Tensor& packed, int64_t n, const at::Tensor& bias, bool silu) {
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4,
              "small_decode: packed bf16 weights");
  Proj p{packed.data_ptr(), silu ? n / 2 : n, packed.size(0), packed_gemm_groups(packed.size(0), silu), {}};
  if (bias.defined() && bias.numel() > 0) {  // as packed_gemm pads it
    p.bias32 = at::zeros({p.nblocks * 16}, bias.options().dtype(at::kFloat));
    p.bias32.narrow(0, 0, n).copy_(bias.to(at::kBFloat16).to(at::kFloat));
  }
  return p;
}

}  // namespace

bool small_decode_supported() { return packed_gemm_part_bf16(); }

// The spin rounds of the barrier between phases (module comment); returns the
// rounds before. For measurements and tests.
int64_t small_decode_spin(int64_t rounds) {
  TORCH_CHECK(rounds >= 0, "small_decode_spin: rounds >= 0");
  return g_spin_rounds.exchange(rounds);
}

at::Tensor small_decode(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                        std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                        at::Tensor seq_lens, at::Tensor query_req, int64_t threads) {
  NoGil no_gil;
  const ModelWeights& s = model;
  TORCH_CHECK(packed_gemm_part_bf16(), "small_decode needs the AVX512-BF16 build");
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0 && s.layers.size() == layers, "small_decode: a KV cache per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kBFloat16,
              "small_decode: hidden [n, hidden] bf16 contiguous");
  const int64_t m = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(m > 0 && positions.numel() == m && slot_mapping.numel() == m && seq_lens.numel() == m,
              "small_decode: a position, a slot and a seq_len per row");
  TORCH_CHECK(query_req.numel() == 0 || query_req.numel() == m, "small_decode: query_req per row or empty");
  TORCH_CHECK(threads >= 1, "small_decode: threads >= 1");
  const int64_t heads = s.num_heads, q_size = heads * s.head_dim;
  std::vector<Proj> qkv, o, gate_up, down;
  const int64_t qkv_n = s.layers[0].qkv.n, inter = s.layers[0].gate_up.n / 2;
  for (const LayerWeights& w : s.layers) {
    qkv.push_back(proj(w.qkv.data, w.qkv.n, w.qkv.bias, false));
    o.push_back(proj(w.o.data, w.o.n, w.o.bias, false));
    TORCH_CHECK(w.gate_up.n % 32 == 0, "small_decode: gate_up on whole blocks of 16 (the fused SiLU tile)");
    gate_up.push_back(proj(w.gate_up.data, w.gate_up.n, at::Tensor(), true));
    down.push_back(proj(w.down.data, w.down.n, at::Tensor(), false));
    TORCH_CHECK(w.o.n == H && w.down.n == H && w.qkv.n == qkv_n && w.gate_up.n == 2 * inter,
                "small_decode: every layer of the same shape, o and down giving the hidden size");
  }
  const auto opts = hidden.options();
  at::Tensor x0 = rms_norm(hidden, s.layers[0].norm1, s.eps);  // layer 0's input (hidden stays the residual)
  at::Tensor residual = hidden;
  at::Tensor qkv_buf = at::empty({m, qkv_n}, opts), attn = at::empty({m, q_size}, opts);
  at::Tensor h1 = at::empty({m, H}, opts), act = at::empty({m, inter}, opts), h2 = at::empty({m, H}, opts);
  const bool per_query_row = query_req.numel() == 0;  // query i reads block table row i
  const int nth = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, omp_get_max_threads())));
  Barrier barrier(nth);
  std::vector<std::exception_ptr> errors(nth);
  std::atomic<bool> failed{false};
  const bool inference = c10::InferenceMode::is_enabled(), grad = at::GradMode::is_enabled();
  // Each thread's GEMM tiles after its attention ask for the next layer's K/V
  // rows of its own requests (kv_prefetch.h), so that its attention there
  // reads them from cache: one query's attention waits on its misses (~50 us
  // a layer cold for 264 tokens, 1.6 ms of a B=1 step), where the prefetch
  // adds ~6% to the bytes the projections stream. Where layer_loop would
  // prefetch (kv_prefetch_on) and a layer's K/V fits the L3.
  const bool prefetch_kv = kv_prefetch_on() && kv_fits_l3(kv_caches, s.layers, seq_lens);
  const at::Tensor pf_lens = seq_lens.to(at::kLong).contiguous(), pf_tab = tables.to(at::kLong).contiguous();
  const at::Tensor pf_req = query_req.numel() ? query_req.to(at::kLong).contiguous() : query_req;

  auto body = [&](int t) {
    omp_set_num_threads(1);  // the kernels' own regions run on this thread alone
    c10::InferenceMode inference_mode(inference);
    at::AutoGradMode grad_mode(grad);
    // Each phase: this thread's part, then everyone's (a failed thread keeps
    // meeting the barriers, so that none waits forever).
    auto phase = [&](auto&& work) {
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          work();
        } catch (...) {
          errors[t] = std::current_exception();
          failed.store(true);
        }
      }
      barrier.wait();
    };
    auto gemm = [&](const Proj& p, const at::Tensor& x, const at::Tensor& y, bool silu) {
      const int64_t g0 = p.groups * t / nth, g1 = p.groups * (t + 1) / nth;
      if (g0 < g1)
        packed_gemm_part(x.data_ptr(), p.w, p.bias32.defined() ? p.bias32.data_ptr<float>() : nullptr,
                         y.data_ptr(), m, x.size(1), p.n, p.nblocks, silu, g0, g1);
    };
    const int64_t r0 = m * t / nth, r1 = m * (t + 1) / nth, rows = r1 - r0;  // this thread's requests
    KvPrefetch stream;  // idle (q == q_end) until filled
    KvPrefetchScope prefetching(&stream);
    for (size_t i = 0; i < layers; ++i) {
      const LayerWeights& w = s.layers[i];
      const at::Tensor& x = i == 0 ? x0 : h2;  // normed in place at the end of the layer before
      phase([&] { gemm(qkv[i], x, qkv_buf, false); });
      phase([&] {
        stream.q = stream.q_end;  // (this layer's rows: what is still to come is needed now)
        if (rows == 0) return;
        at::Tensor mine = qkv_buf.narrow(0, r0, rows);
        rope_qkv_cache(mine, heads, s.num_kv_heads, s.head_dim, positions.narrow(0, r0, rows), s.cos, s.sin,
                       kv_caches[i], slot_mapping.narrow(0, r0, rows));
        const at::Tensor q = mine.narrow(1, 0, q_size).view({rows, heads, s.head_dim});
        const at::Tensor req = per_query_row ? query_req : query_req.narrow(0, r0, rows);
        const at::Tensor tab = per_query_row ? tables.narrow(0, r0, rows) : tables;
        attn.narrow(0, r0, rows)
            .copy_(paged_decode(q, kv_caches[i], tab, seq_lens.narrow(0, r0, rows), w.scale, w.sliding_window, req)
                       .view({rows, q_size}));
      });
      if (prefetch_kv && rows > 0 && i + 1 < layers) {  // fed through o, gate_up, down and the next qkv
        stream = kv_stream(kv_caches[i + 1], pf_tab, pf_lens, pf_req, s.layers[i + 1].sliding_window);
        stream.q = r0;
        stream.q_end = r1;
      }
      phase([&] { gemm(o[i], attn, h1, false); });
      phase([&] {
        if (t == 0) fused_add_rms_norm(h1, residual, w.norm2, s.eps);
      });
      phase([&] { gemm(gate_up[i], h1, act, true); });
      phase([&] { gemm(down[i], act, h2, false); });
      phase([&] {
        if (t == 0) fused_add_rms_norm(h2, residual, i + 1 < layers ? s.layers[i + 1].norm1 : s.final_norm, s.eps);
      });
    }
  };
  // (A team of one too: omp_set_num_threads(1) then holds inside the region only.)
#pragma omp parallel num_threads(nth)
  body(omp_get_thread_num());
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  return h2;
}
