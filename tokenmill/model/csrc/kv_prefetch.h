// The K/V rows that the next layer's attention will read, asked for from
// memory while this thread runs the current layer's projections.
//
// The decode attention kernel is bound by each core's own misses in flight
// (~10 GB/s a core), not by the memory bus, while the projections after it
// (o_proj, gate_up, down) are bound by compute and leave the bus nearly idle.
// So in layer_stack's split steps (each thread its own requests through every
// layer) a thread's GEMM tiles ask, every 16 of their steps, for one context
// row (K and V, every cache line) of its own queries in the next layer, in
// the order the kernel will read them. The rows land in L2 and spill to L3,
// from where the kernel reads them about twice as fast as from memory
// (B=64, context 264: the kernel 0.62 ms a layer cold, 0.30 in cache). Only
// where the layer's K/V fits L3 with room to spare and a thread has at most
// 48 rows (layer_stack.cpp says what was measured): with 64 rows a thread
// the projections slowed by as much as the attention gained.
//
// Prefetches change no result: every number is the same bits with or without.
#pragma once
#include <cstdint>
#include <xmmintrin.h>

struct KvPrefetch {
  const char* k = nullptr;          // the layer's K (bytes); each row's V sits v_off bytes after it
  int64_t v_off = 0;
  const int64_t* table = nullptr;   // block tables [rows, max_blocks]
  int64_t max_blocks = 0;
  const int64_t* lens = nullptr;    // seq_len of each query
  const int64_t* req = nullptr;     // table row of each query, or null: query i reads row i
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
    const char* row = k + table[(req ? req[q] : q) * max_blocks + blk] * block_bytes + off * row_bytes;
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
    const char* row = take_row();
    for (int64_t o = 0; o < row_bytes; o += 64) {
      _mm_prefetch(row + o, _MM_HINT_T1);
      _mm_prefetch(row + v_off + o, _MM_HINT_T1);
    }
  }
};

// The stream this thread's GEMM tiles feed (packed_gemm.cpp), or null.
inline thread_local KvPrefetch* tl_kv_prefetch = nullptr;

// Sets this thread's stream for a scope (and clears it, also on an exception).
struct KvPrefetchScope {
  explicit KvPrefetchScope(KvPrefetch* p) { tl_kv_prefetch = p; }
  ~KvPrefetchScope() { tl_kv_prefetch = nullptr; }
  KvPrefetchScope(const KvPrefetchScope&) = delete;
  KvPrefetchScope& operator=(const KvPrefetchScope&) = delete;
};
