// The decoder layers in one call from Python, two ways. layer_loop: plan.py's
// layer loop itself, every kernel on the whole OpenMP team (any step; no Python
// between the ~270 kernel calls). layer_stack: the decoder layers with the
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
// Two threads do not overlap attention (memory) with projections (compute) by
// themselves: the attention kernel is bound by each core's own misses in
// flight, not by the memory bus. Instead each thread's projections ask for
// the next layer's K/V of its queries (kv_prefetch.h), where a layer's K/V
// fits the L3 and a thread has at most 48 rows.
//
// Every row's result is the same bits as through the layer loop: each kernel
// computes a row (a query, a token) the same way whatever rows are around it
// (tests/test_model_numerics.py: test_split_layer_stack_gives_the_same_bits).
//
//   model       the weights and shape, by name (layer_stack.h)
//   hidden      [n, hidden] the embeddings (changed in place, as plan.py does)
//   kv_caches   one per layer; slot_mapping: each row's cache slot
//   tables, seq_lens, query_req: paged_decode's arguments for all n queries
//   bounds      [0, r1, ..., n]: thread t takes rows [bounds[t], bounds[t+1]),
//               each a run of whole requests
//   -> [n, hidden] after the final norm
#include <torch/extension.h>

#include "kv_prefetch.h"
#include "layer_stack.h"
#include "no_gil.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <omp.h>

at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor seq_lens,
                        double scale, int64_t sliding_window, at::Tensor query_req);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rope_qkv_cache(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                    at::Tensor slot_mapping);
at::Tensor silu_and_mul(at::Tensor gate_up);

namespace {
constexpr int64_t kPrefetchMaxRows = 48;  // a thread's rows, past which the K/V prefetch did not pay
// Below this many rows the projections are bound by reading the weights, and
// the prefetch competes with them.
constexpr int64_t kTeamPrefetchMinRows = 8;

// Whether x's dtype runs on the AVX512-BF16 kernels, where the K/V prefetch
// was measured to pay; the AVX2 build's bf16 (float32 math) was slower with it.
bool avx512_bf16(const at::Tensor& x) {
#if defined(__AVX512BF16__)
  return x.scalar_type() == at::kBFloat16;
#else
  (void)x;
  return false;
#endif
}

// Whether this CPU is one where the projections' K/V prefetch was measured to
// pay: AMD's family 25, of which the Zen 4 has AVX512-BF16 (which the prefetch
// needs too: avx512_bf16; the Zen 3 is family 25 without it). On a Zen 5
// (family 26) it cost instead: the projections of a few dozen rows are bound
// by reading their weights there, and the extra K/V traffic slows them. Other
// CPUs (not measured) go without (docs/perf-notes.md).
bool kv_prefetch_pays() {
  static const bool pays = [] {
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx) || ebx != 0x68747541u)  // "Auth(enticAMD)"
      return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xf, family = base == 0xf ? base + ((eax >> 20) & 0xff) : base;
    return family == 25;
#else
    return false;
#endif
  }();
  return pays;
}

// -1: as kv_prefetch_pays says; 0: never; 1: wherever it applies (tests set it:
// kv_prefetch_mode below).
std::atomic<int> g_kv_prefetch{-1};
bool kv_prefetch_on() {
  const int mode = g_kv_prefetch.load(std::memory_order_relaxed);
  return mode < 0 ? kv_prefetch_pays() : mode > 0;
}

// This machine's L3 in bytes (Linux sysfs), or 0 where unknown.
int64_t l3_bytes() {
  static const int64_t bytes = [] {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index3/size");
    int64_t n = 0;
    char unit = 0;
    if (!(f >> n)) return int64_t(0);
    f >> unit;
    return unit == 'K' ? n << 10 : unit == 'M' ? n << 20 : n;
  }();
  return bytes;
}

void check_stack(const ModelWeights& s, const std::vector<at::Tensor>& kv_caches, const at::Tensor& hidden,
                 const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                 const at::Tensor& query_req) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0 && s.layers.size() == layers, "layer_stack: a KV cache per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "layer_stack: hidden [n, hidden] contiguous");
  const int64_t n = hidden.size(0);
  TORCH_CHECK(positions.numel() == n && slot_mapping.numel() == n && seq_lens.numel() == n,
              "layer_stack: a position, a slot and a seq_len per row");
  TORCH_CHECK(query_req.numel() == 0 || query_req.numel() == n, "layer_stack: query_req per row or empty");
}

// Whether a layer's K/V for these queries (the largest layer's: windows may
// differ) fits 3/4 of L3, where the prefetch of kv_prefetch.h pays.
bool kv_fits_l3(const std::vector<at::Tensor>& kv_caches, const std::vector<LayerWeights>& layers,
                const at::Tensor& seq_lens) {
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t* l = lens.data_ptr<int64_t>();
  int64_t kv_bytes = 0;
  for (size_t i = 0; i < kv_caches.size(); ++i) {
    const int64_t window = layers[i].sliding_window;
    int64_t rows = 0;
    for (int64_t j = 0; j < lens.numel(); ++j) rows += window > 0 ? std::min(l[j], window) : l[j];
    kv_bytes = std::max(kv_bytes, 2 * rows * kv_caches[i].stride(2) * kv_caches[i].element_size());
  }
  return kv_bytes <= l3_bytes() / 4 * 3;
}

// The stream of K/V rows paged_decode will read for these queries in this
// cache (int64 contiguous tables, lens, req), in its order.
KvPrefetch kv_stream(const at::Tensor& cache, const at::Tensor& tab, const at::Tensor& lens, const at::Tensor& req,
                     int64_t window) {
  KvPrefetch p;
  const int64_t es = cache.element_size();
  p.k = static_cast<const char*>(cache.data_ptr());
  p.v_off = cache.stride(0) * es;
  p.table = tab.data_ptr<int64_t>();
  p.max_blocks = tab.size(1);
  p.lens = lens.data_ptr<int64_t>();
  p.req = req.numel() ? req.data_ptr<int64_t>() : nullptr;
  p.window = window;
  p.block_size = cache.size(2);
  p.block_bytes = cache.stride(1) * es;
  p.row_bytes = cache.stride(2) * es;
  p.q_end = lens.numel();
  return p;
}

// Rows h (changed in place) through every layer and the final norm, each
// kernel with the OpenMP team it gets; `req` empty: query i reads table row i.
// With `out_rows`, the last layer runs on past its K/V write for those rows
// only (the result has one row each), as plan.py does. With a
// prefetch mode, the projections after each layer's attention ask for the
// next layer's K/V rows of these queries (kv_prefetch.h): kOwn, all of them
// (this thread runs every kernel alone, in layer_stack); kTeam, each thread of
// the OpenMP team the rows its part of the attention kernel will read.
enum class Prefetch { kNone, kOwn, kTeam };

// Points every thread of the team at its stream for a scope (each stream idle
// until filled), and clears the pointers again, also on an exception.
struct TeamStreams {
  std::vector<KvPrefetch> streams;
  explicit TeamStreams(int nth) : streams(nth) {
#pragma omp parallel num_threads(nth)
    tl_kv_prefetch = &streams[omp_get_thread_num()];
  }
  ~TeamStreams() {
#pragma omp parallel num_threads(static_cast<int>(streams.size()))
    tl_kv_prefetch = nullptr;
  }
  TeamStreams(const TeamStreams&) = delete;
  TeamStreams& operator=(const TeamStreams&) = delete;
};

// ---- The shared-memory all-reduce (tensor parallelism, ranks on one machine) ----
// The region: `size` flags, each on its own 64-byte line (the last sequence
// number rank r posted), then two sets (by the sequence's parity) of `size`
// slots of `capacity` floats. An all-reduce, on each rank: copy its part into
// its slot of this sequence's set, post the sequence (release), wait until
// every rank has posted it (acquire), then sum the slots in rank order, so
// every rank computes the same bits. A slot of sequence s is written again at
// s + 2 only, and a rank posts s + 1 only after it has read s's slots: so
// each operation first waits until every rank has posted s - 1 (at once,
// unless the last one was a gather, which does not wait on the others' side).
constexpr int64_t kShmLine = 64;

int64_t* shm_flag(const ShmGroup& g, int64_t r) {
  return reinterpret_cast<int64_t*>(static_cast<uint8_t*>(g.region.data_ptr()) + r * kShmLine);
}

float* shm_slot(const ShmGroup& g, int64_t seq, int64_t r) {
  const int64_t index = (seq & 1) * g.size + r;
  return reinterpret_cast<float*>(static_cast<uint8_t*>(g.region.data_ptr()) + g.size * kShmLine) +
         index * g.capacity;
}

// Whether process `pid` has exited (gone, or a zombie: its memory and files released).
bool process_gone(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return true;
  const size_t close = line.rfind(')');  // (the name may hold spaces and parentheses)
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state == 'Z' || state == 'X' || state == 'x';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Until rank q has posted `seq`: spin a few microseconds (the other rank is
// usually a layer's imbalance away), then yield, then sleep; every few ms check
// that q is alive and the step's timeout. A dead or stuck peer throws. `idle`
// (a worker waiting for rank 0's next command): no timeout, and after 100 ms
// longer sleeps.
void shm_wait(const ShmGroup& g, int64_t q, int64_t seq, bool idle = false) {
  const int64_t* flag = shm_flag(g, q);
  if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= seq) return;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point check = start;
  for (int64_t round = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; ++round) {
    if (round < 20000) {
      cpu_relax();
      continue;
    }
    if (round < 22000) {
      sched_yield();
    } else {
      const bool long_idle = idle && Clock::now() - start > std::chrono::milliseconds(100);
      std::this_thread::sleep_for(std::chrono::microseconds(long_idle ? 500 : 50));
    }
    const Clock::time_point now = Clock::now();
    if (now - check < std::chrono::milliseconds(5)) continue;
    check = now;
    TORCH_CHECK(!process_gone(g.pids[q]), "tensor-parallel shared memory: rank ", q, " (pid ",
                g.pids[q], ") is gone");
    TORCH_CHECK(idle || std::chrono::duration<double>(now - start).count() < g.timeout_s,
                "tensor-parallel shared memory: no answer from rank ", q, " within ", g.timeout_s,
                " s");
  }
}

// t (float32, contiguous) summed over the ranks, in place, in chunks of a slot.
void shm_reduce(const ShmGroup& g, at::Tensor& t) {
  float* data = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t off = 0; off < n; off += g.capacity) {  // (every rank has the same n)
    const int64_t m = std::min(g.capacity, n - off);
    int64_t* mine = shm_flag(g, g.rank);
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;  // (only this rank writes it)
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq - 1);
    std::memcpy(shm_slot(g, seq, g.rank), data + off, m * sizeof(float));
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq);
    float* out = data + off;
    const float* first = shm_slot(g, seq, 0);
    for (int64_t i = 0; i < m; ++i) out[i] = first[i];
    for (int64_t q = 1; q < g.size; ++q) {
      const float* part = shm_slot(g, seq, q);
      for (int64_t i = 0; i < m; ++i) out[i] += part[i];
    }
  }
}

// Each rank's [rows, widths[r]] side by side in `out` on rank 0, in chunks of
// whole rows: the others copy theirs into their slot and go on; rank 0 waits
// for every slot and copies each into its columns.
void shm_gather_rows(const ShmGroup& g, const float* local, float* out, const std::vector<int64_t>& widths,
                     int64_t rows) {
  const int64_t max_w = *std::max_element(widths.begin(), widths.end());
  int64_t total = 0;
  std::vector<int64_t> col(widths.size());
  for (size_t q = 0; q < widths.size(); ++q) col[q] = total, total += widths[q];
  const int64_t per = std::max<int64_t>(1, g.capacity / std::max<int64_t>(1, max_w));
  const int64_t w = widths[g.rank];
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t m = std::min(per, rows - r0);
    int64_t* mine = shm_flag(g, g.rank);
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq - 1);
    if (g.rank != 0) {
      std::memcpy(shm_slot(g, seq, g.rank), local + r0 * w, m * w * sizeof(float));
      __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
      continue;
    }
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
    for (int64_t q = 0; q < g.size; ++q) {
      const float* src = local + r0 * w;
      if (q != 0) {
        shm_wait(g, q, seq);
        src = shm_slot(g, seq, q);
      }
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(out + (r0 + i) * total + col[q], src + i * widths[q], widths[q] * sizeof(float));
    }
  }
}

// Rank 0's bytes to the others through its own slots, a chunk a sequence (the
// first starts with the total length); the others post each sequence once
// they have read its chunk.
void shm_send_bytes(const ShmGroup& g, const uint8_t* data, int64_t n) {
  const int64_t cap = g.capacity * int64_t(sizeof(float));
  int64_t* mine = shm_flag(g, g.rank);
  for (int64_t off = 0, chunk = 0; chunk == 0 || off < n; ++chunk) {
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    for (int64_t q = 0; q < g.size; ++q)
      if (q != g.rank) shm_wait(g, q, seq - 1);
    uint8_t* slot = reinterpret_cast<uint8_t*>(shm_slot(g, seq, g.rank));
    const int64_t head = chunk == 0 ? int64_t(sizeof(int64_t)) : 0;
    if (chunk == 0) std::memcpy(slot, &n, sizeof(int64_t));
    const int64_t m = std::min(cap - head, n - off);
    std::memcpy(slot + head, data + off, m);
    off += m;
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
  }
}

at::Tensor shm_receive_bytes(const ShmGroup& g) {
  const int64_t cap = g.capacity * int64_t(sizeof(float));
  int64_t* mine = shm_flag(g, g.rank);
  at::Tensor out;
  int64_t n = 0;
  for (int64_t off = 0, chunk = 0; chunk == 0 || off < n; ++chunk) {
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    shm_wait(g, 0, seq, /*idle=*/chunk == 0);
    const uint8_t* slot = reinterpret_cast<const uint8_t*>(shm_slot(g, seq, 0));
    const int64_t head = chunk == 0 ? int64_t(sizeof(int64_t)) : 0;
    if (chunk == 0) {
      std::memcpy(&n, slot, sizeof(int64_t));
      out = at::empty({n}, at::kByte);
    }
    const int64_t m = std::min(cap - head, n - off);
    std::memcpy(out.data_ptr<uint8_t>() + off, slot + head, m);
    off += m;
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
  }
  return out;
}

void check_group(const ShmGroup& g) {
  TORCH_CHECK(g.size >= 1 && g.rank >= 0 && g.rank < g.size && static_cast<int64_t>(g.pids.size()) == g.size,
              "ShmGroup: rank, size and a pid per rank");
  TORCH_CHECK(g.region.is_contiguous() && g.region.scalar_type() == at::kByte && g.capacity > 0 &&
                  g.region.numel() >= g.size * kShmLine + 2 * g.size * g.capacity * int64_t(sizeof(float)),
              "ShmGroup: the region holds the flags and 2 x size slots of capacity floats");
}

// o_proj / down_proj: packed_gemm, or on a shard (tp) its float32 partial sum
// all-reduced over the ranks and rounded once (as the whole GEMM rounds its sum).
at::Tensor row_parallel(const at::Tensor& x, const PackedWeight& w, const ShmGroup* tp) {
  if (!tp) return packed_gemm(x, w, false);
  at::Tensor sum = packed_gemm(x, w, true);
  shm_reduce(*tp, sum);
  return sum.to(x.scalar_type());
}

// With `tp` (a tensor-parallel shard's group), o_proj and down_proj are row-parallel:
// their float32 sums are all-reduced, then rounded once, as plan.py's shard loop does.
at::Tensor run_layers(const ModelWeights& s, const std::vector<at::Tensor>& kv_caches, at::Tensor h, const at::Tensor& pos, const at::Tensor& slots,
                      at::Tensor lens, at::Tensor req, const at::Tensor& tab, const at::Tensor* out_rows,
                      Prefetch prefetch = Prefetch::kNone, const ShmGroup* tp = nullptr) {
  const size_t layers = kv_caches.size();
  const int64_t q_size = s.num_heads * s.head_dim;
  int64_t m = h.size(0);
  at::Tensor residual = h;
  at::Tensor pf_lens, pf_tab, pf_req;  // paged_decode's arguments as the prefetch stream reads them
  std::unique_ptr<TeamStreams> team;
  if (prefetch == Prefetch::kTeam) team = std::make_unique<TeamStreams>(omp_get_max_threads());
  if (prefetch != Prefetch::kNone) {
    pf_lens = lens.to(at::kLong).contiguous();
    pf_tab = tab.to(at::kLong).contiguous();
    pf_req = req.numel() ? req.to(at::kLong).contiguous() : req;
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
    at::Tensor qkv = packed_gemm(x, w.qkv, false);
    rope_qkv_cache(qkv, s.num_heads, s.num_kv_heads, s.head_dim, pos, s.cos, s.sin, kv_caches[i], slots);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({m, s.num_heads, s.head_dim});
    if (out_rows && i + 1 == layers) {  // every K/V is written: the rest for the rows out
      q = q.index_select(0, *out_rows);
      residual = residual.index_select(0, *out_rows);
      lens = lens.index_select(0, *out_rows);
      req = req.numel() ? req.index_select(0, *out_rows) : *out_rows;
      m = out_rows->numel();
    }
    at::Tensor out = paged_decode(q, kv_caches[i], tab, lens, w.scale, w.sliding_window, req);
    // The next layer's K/V rows, fed by the GEMM tiles below until the end of this layer.
    const bool pf = prefetch != Prefetch::kNone && i + 1 < layers && !(out_rows && i + 2 == layers);
    KvPrefetch next_kv;
    if (pf) next_kv = kv_stream(kv_caches[i + 1], pf_tab, pf_lens, pf_req, s.layers[i + 1].sliding_window);
    if (pf && team) {  // each thread the queries its part of the kernel takes
      const int64_t nth = static_cast<int64_t>(team->streams.size());
      for (int64_t t = 0; t < nth; ++t) {
        KvPrefetch& p = team->streams[t] = next_kv;
        query_range(next_kv.lens, next_kv.q_end, next_kv.window, t, nth, p.q, p.q_end);
      }
    }
    KvPrefetchScope prefetching(pf && !team ? &next_kv : nullptr);
    h = row_parallel(out.view({m, q_size}), w.o, tp);
    fused_add_rms_norm(h, residual, w.norm2, s.eps);
    // gate/up on whole blocks of 16: silu(gate) * up from the GEMM's tiles.
    const bool fused_silu = w.gate_up.n % 32 == 0;
    const at::Tensor act = fused_silu ? packed_gemm_silu(h, w.gate_up) : silu_and_mul(packed_gemm(h, w.gate_up, false));
    h = row_parallel(act, w.down, tp);
    if (team)
      for (KvPrefetch& p : team->streams) p.q = p.q_end;  // idle through the next layer's qkv and attention
  }
  fused_add_rms_norm(h, residual, s.final_norm, s.eps);
  return h;
}

}  // namespace

// The layer loop of plan.py in one call (no Python between the ~270
// kernel calls of a step), every kernel on the whole OpenMP
// team, in the same order: the same bits. For any step: every row's K/V of a
// layer is written before any row of it attends, as a prefill that hits the
// prefix cache on a block written in the same step needs. output_rows: the
// rows to return (all of them when all_rows).
namespace {
at::Tensor layer_loop_impl(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                           std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                           at::Tensor seq_lens, at::Tensor query_req, at::Tensor output_rows, bool all_rows,
                           const ShmGroup* tp) {
  NoGil no_gil;
  const ModelWeights& s = model;
  const int64_t head_dim = s.head_dim;
  check_stack(s, kv_caches, hidden, positions, slot_mapping, seq_lens, query_req);
  if (!all_rows) output_rows = output_rows.to(at::kLong).contiguous();
  // The K/V prefetch (kv_prefetch.h) as in layer_stack's split steps, each
  // thread for the queries its part of the bf16 attention kernel takes: for
  // decode-only steps (no two queries of one request) of 8 to kPrefetchMaxRows
  // rows. (Not with dynamic teams: a team smaller than the one whose pointers
  // were set could leave a thread's pointer behind.) Not in float32 on AVX2,
  // where it cost (docs/perf-notes.md).
  const bool bf16_kernel = avx512_bf16(hidden) &&  // (its split is query_range's)
                           (head_dim == 32 || head_dim == 64 || head_dim == 128);
  bool prefetch = !omp_get_dynamic() && bf16_kernel && kv_prefetch_on() &&
                  hidden.size(0) >= kTeamPrefetchMinRows && hidden.size(0) <= kPrefetchMaxRows &&
                  kv_fits_l3(kv_caches, s.layers, seq_lens);
  if (prefetch && query_req.numel()) {
    const at::Tensor r = query_req.to(at::kLong).contiguous();
    const int64_t* q = r.data_ptr<int64_t>();
    for (int64_t i = 1; i < r.numel() && prefetch; ++i) prefetch = q[i] != q[i - 1];
  }
  return run_layers(s, kv_caches, hidden, positions, slot_mapping, seq_lens, query_req, tables,
                    all_rows ? nullptr : &output_rows, prefetch ? Prefetch::kTeam : Prefetch::kNone, tp);
}
}  // namespace

at::Tensor layer_loop(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                      std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                      at::Tensor seq_lens, at::Tensor query_req, at::Tensor output_rows, bool all_rows) {
  return layer_loop_impl(model, hidden, positions, std::move(kv_caches), slot_mapping, tables, seq_lens,
                         query_req, output_rows, all_rows, nullptr);
}

// layer_loop on a tensor-parallel shard whose ranks share this machine: the
// all-reduce after each o_proj and down_proj over `group`'s shared memory,
// inside the loop (no Python between the kernels of a step).
at::Tensor layer_loop_tp(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                         std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                         at::Tensor seq_lens, at::Tensor query_req, at::Tensor output_rows, bool all_rows,
                         const ShmGroup& group) {
  check_group(group);
  return layer_loop_impl(model, hidden, positions, std::move(kv_caches), slot_mapping, tables, seq_lens,
                         query_req, output_rows, all_rows, &group);
}

// Rank r's `local` [rows, widths[r]] (float32) side by side in rank 0's `out`
// [rows, sum(widths)] (the others pass an empty `out`), over `group`'s shared
// memory: the logits' gather. A rank's widths[r] at most the slot's capacity.
void shm_gather(const ShmGroup& group, at::Tensor local, at::Tensor out, std::vector<int64_t> widths) {
  check_group(group);
  TORCH_CHECK(static_cast<int64_t>(widths.size()) == group.size, "shm_gather: a width per rank");
  TORCH_CHECK(local.scalar_type() == at::kFloat && local.is_contiguous() && local.dim() == 2 &&
                  local.size(1) == widths[group.rank],
              "shm_gather: local [rows, widths[rank]] contiguous float32");
  TORCH_CHECK(*std::max_element(widths.begin(), widths.end()) <= group.capacity,
              "shm_gather: a width past the slot's capacity");
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  if (group.rank == 0)
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                    out.size(0) == local.size(0) && out.size(1) == total,
                "shm_gather: out [rows, sum(widths)] contiguous float32 on rank 0");
  NoGil no_gil;
  shm_gather_rows(group, local.data_ptr<float>(), group.rank == 0 ? out.data_ptr<float>() : nullptr, widths,
                  local.size(0));
}

// Rank 0's command bytes (uint8 [n]) to the other ranks of `group`
// (shm_receive there): a step's broadcast over shared memory.
void shm_send(const ShmGroup& group, at::Tensor data) {
  check_group(group);
  TORCH_CHECK(group.rank == 0, "shm_send: rank 0 sends");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 1, "shm_send: uint8 [n]");
  NoGil no_gil;
  shm_send_bytes(group, data.data_ptr<uint8_t>(), data.numel());
}

// The next bytes rank 0 sends; waits as long as it takes (rank 0 may idle),
// but throws once rank 0's process is gone.
at::Tensor shm_receive(const ShmGroup& group) {
  check_group(group);
  TORCH_CHECK(group.rank != 0, "shm_receive: the other ranks receive");
  NoGil no_gil;
  return shm_receive_bytes(group);
}

// `t` (float32, contiguous) summed over `group`'s ranks, in place: the same
// bits on every rank (the slots added in rank order). Blocks until every rank
// has called it; throws where a peer has died or timed out.
void shm_all_reduce(const ShmGroup& group, at::Tensor t) {
  check_group(group);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
              "shm_all_reduce: a contiguous float32 CPU tensor");
  NoGil no_gil;
  shm_reduce(group, t);
}

// When layer_loop and layer_stack ask for the next layer's K/V during the
// projections: -1 where kv_prefetch_pays (the default), 0 never, 1 wherever
// it applies (tests, so that they run the prefetching code on any CPU).
// Returns the mode before.
int64_t kv_prefetch_mode(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "kv_prefetch_mode: -1, 0 or 1");
  return g_kv_prefetch.exchange(static_cast<int>(mode));
}

// The cache slots (block * block_size + offset) of the K rows that the
// prefetch stream of kv_prefetch.h visits, in order: for tests, which check
// them against the rows the attention kernel reads.
at::Tensor kv_prefetch_rows(at::Tensor kv_cache, at::Tensor tables, at::Tensor seq_lens, at::Tensor query_req,
                            int64_t window) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache [2, blocks, block_size, kv_heads, head_dim]");
  tables = tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  query_req = query_req.to(at::kLong).contiguous();
  KvPrefetch p = kv_stream(kv_cache, tables, seq_lens, query_req, window);
  std::vector<int64_t> slots;
  while (p.q < p.q_end) slots.push_back((p.take_row() - p.k) / p.row_bytes);
  return at::tensor(slots, at::kLong);
}

at::Tensor layer_stack(const ModelWeights& model, at::Tensor hidden, at::Tensor positions,
                       std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping, at::Tensor tables,
                       at::Tensor seq_lens, at::Tensor query_req, std::vector<int64_t> bounds) {
  // A whole forward (up to ~150 ms) without Python: let the server's other
  // threads (HTTP, streaming) run meanwhile. Re-taken on the way out.
  NoGil no_gil;
  const ModelWeights& s = model;
  check_stack(s, kv_caches, hidden, positions, slot_mapping, seq_lens, query_req);
  const int64_t n = hidden.size(0);
  TORCH_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == n &&
                  std::is_sorted(bounds.begin(), bounds.end()),
              "layer_stack: bounds [0, ..., n], ascending");
  const bool per_query_row = query_req.numel() == 0;  // query i reads block table row i
  // The next layer's K/V asked for during each layer's projections
  // (kv_prefetch.h) where a layer's K/V (all threads') fits 3/4 of L3 and a
  // thread has at most kPrefetchMaxRows rows, in bf16 on CPUs where it pays
  // (kv_prefetch_pays; float32 goes without: docs/perf-notes.md).
  const bool prefetch_kv = avx512_bf16(hidden) && kv_prefetch_on() && kv_fits_l3(kv_caches, s.layers, seq_lens);
  at::Tensor result = at::empty_like(hidden);
  const int threads = static_cast<int>(bounds.size() - 1);
  std::vector<std::exception_ptr> errors(threads);
  // Thread-local modes of the caller, for the other threads too.
  const bool inference = c10::InferenceMode::is_enabled(), grad = at::GradMode::is_enabled();

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    try {
      omp_set_num_threads(1);  // the kernels' own regions run on this thread alone
      c10::InferenceMode inference_mode(inference);
      at::AutoGradMode grad_mode(grad);
      const int64_t r0 = bounds[t], m = bounds[t + 1] - r0;
      if (m > 0) {
        const at::Tensor req = per_query_row ? query_req : query_req.narrow(0, r0, m);
        const at::Tensor tab = per_query_row ? tables.narrow(0, r0, m) : tables;
        result.narrow(0, r0, m).copy_(run_layers(s, kv_caches, hidden.narrow(0, r0, m), positions.narrow(0, r0, m),
                                                 slot_mapping.narrow(0, r0, m), seq_lens.narrow(0, r0, m),
                                                 req, tab, nullptr,
                                                 prefetch_kv && m <= kPrefetchMaxRows ? Prefetch::kOwn
                                                                                      : Prefetch::kNone));
      }
    } catch (...) {
      errors[t] = std::current_exception();
    }
  }
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  return result;
}
