// The K/V rows that the next layer's attention will read, asked for from
// memory while this thread runs the current layer's projections.
//
// The decode attention kernel is bound by each core's own misses in flight
// (~10 GB/s a core), not by the memory bus, while the projections after it
// (o_proj, gate_up, down) are bound by compute and leave the bus nearly idle.
// So in decode steps a thread's GEMM tiles ask, every 16 of their steps, for
// one context row (K and V, every cache line) of the next layer, in the order
// the kernel will read them: of its own queries in layer_stack's split steps
// (each thread its own requests through every layer), of the queries its part
// of the attention kernel takes (query_range) in the layer loop. The rows land
// in L2 and spill to L3, from where the kernel reads them about twice as fast
// as from memory. Only in bf16, where the layer's K/V fits L3 with room to spare and
// a thread has at most 48 rows (cpu_features.cpp says what was measured): with
// 64 rows a thread the projections slowed by as much as the attention gained,
// and in float32 on a Zen 3 the steps were slower with it. In the layer
// loop only from 8 rows: below, the projections are bound by reading the
// weights, and the prefetch competes with them.
// Only on a Zen 4: on a Zen 5 it made the steps slower (cpu_features.cpp
// kv_prefetch_pays).
//
// Prefetches change no result: every number is the same bits with or without.
#pragma once
#include <cstdint>
#include <xmmintrin.h>

// One cache line into the level Hint names (_MM_HINT_T0, _T1, _T2, _NTA), as
// _mm_prefetch does, but never dropped by the compiler: GCC 12 (-O1 and up)
// deleted every prefetch of a lambda that did nothing else (it finds such a
// lambda free of side effects and drops the call), which left the AVX2 and
// AVX-512 float attention kernels without the prefetches their source asked
// for (objdump: no prefetch instruction in them; paged_attention.cpp says what
// they measured once made to work). An asm volatile statement stays.
template <auto Hint>
inline void prefetch_line(const char* p) {
  if constexpr (Hint == _MM_HINT_T0) asm volatile("prefetcht0 %0" : : "m"(*p));
  else if constexpr (Hint == _MM_HINT_T1) asm volatile("prefetcht1 %0" : : "m"(*p));
  else if constexpr (Hint == _MM_HINT_T2) asm volatile("prefetcht2 %0" : : "m"(*p));
  else asm volatile("prefetchnta %0" : : "m"(*p));
}

// Every cache line of one K row (row_bytes from k) and of its V row (v_off
// bytes after it), into the cache level Hint names.
template <auto Hint>
inline void prefetch_kv_row(const char* k, int64_t v_off, int64_t row_bytes) {
  for (int64_t o = 0; o < row_bytes; o += 64) {
    prefetch_line<Hint>(k + o);
    prefetch_line<Hint>(k + v_off + o);
  }
}

struct KvPrefetch {
  const char* k = nullptr;          // the layer's K (bytes); each row's V sits v_off bytes after it
  int64_t v_off = 0;
  const int64_t* table = nullptr;   // block tables [rows, max_blocks]
  int64_t max_blocks = 0;
  const int64_t* lens = nullptr;    // seq_len of each query
  const int64_t* seq = nullptr;     // each query's sequence (table row), or null: query i reads row i
  int64_t window = 0;               // the layer's sliding window (0: none)
  int64_t block_size = 0, block_bytes = 0, row_bytes = 0;
  int64_t q = 0, q_end = 0;         // queries [q, q_end) still to come
  int64_t t = -1, blk = 0, off = 0; // query q's next token t (block blk of its table, offset off); -1: not started

  // The K row of query q's next context token, and on to the token after it
  // (the caller checks q < q_end first).
  inline const char* take_row() {
    if (t < 0) {  // query q's first context token (its window's first)
      t = window > 0 && lens[q] > window ? lens[q] - window : 0;
      blk = t / block_size;
      off = t % block_size;
    }
    const char* row = k + table[(seq ? seq[q] : q) * max_blocks + blk] * block_bytes + off * row_bytes;
    if (++off == block_size) {
      off = 0;
      ++blk;
    }
    if (++t >= lens[q]) {
      t = -1;
      ++q;
    }
    return row;
  }

  // Every cache line of one K row and of its V row.
  inline void next_row() {
    if (q >= q_end) return;
    prefetch_kv_row<_MM_HINT_T1>(take_row(), v_off, row_bytes);
  }
};

// The queries [lo, hi) that thread tid of nth takes in paged_attention's bf16
// kernel: contiguous ranges of about equal work, a query costing its context
// (its window's) and a fixed 16 (the queries of a prefill chunk cost more the
// later they sit). Shared with the layer loop's streams, so that each thread
// prefetches the rows its own attention will read.
inline void query_range(const int64_t* lens, int64_t n, int64_t window, int64_t tid, int64_t nth,
                        int64_t& lo, int64_t& hi) {
  auto cost = [&](int64_t b) { return (window > 0 && lens[b] > window ? window : lens[b]) + 16; };
  int64_t total = 0;
  for (int64_t b = 0; b < n; ++b) total += cost(b);
  int64_t acc = 0, b = 0;
  for (; b < n && acc * nth < total * tid; ++b) acc += cost(b);
  lo = b;
  for (; b < n && acc * nth < total * (tid + 1); ++b) acc += cost(b);
  hi = tid == nth - 1 ? n : b;
}

// The K/V prefetch streams one GEMM call's tiles feed, passed to it as an
// argument by the layer calls (layer_loop.cpp): thread t of the OpenMP team
// that runs the GEMM feeds streams[t] (t < threads); none where streams is
// null (every other call). In layer_stack's split steps the GEMM runs on its
// thread alone (thread 0 of a team of one): one stream.
struct KvStreams {
  KvPrefetch* streams = nullptr;
  int64_t threads = 0;

  // Thread t's stream where it has rows still to ask for, else null.
  KvPrefetch* of_thread(int64_t t) const {
    KvPrefetch* p = t < threads ? streams + t : nullptr;
    return p && p->q < p->q_end ? p : nullptr;
  }
};
