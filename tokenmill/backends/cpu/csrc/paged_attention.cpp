// Paged attention for the CPU, one query token at a time, reading K/V in place
// from the paged cache (no gathered copy of the context). A decode is one query;
// a prefill chunk of n tokens is n queries of the same request, each seeing the
// context up to its own position (causal), so one call serves a whole step.
//
//   q            [num_queries, num_heads, head_dim]        (float32 or bfloat16; rows may be
//                                                          strided, e.g. a view of qkv rows)
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, entry]  (q's dtype, entry = head_dim;
//                                                          or q8_0 / fp8: kv_format.h)
//   block_tables [num_reqs, max_num_blocks] int64
//   seq_lens     [num_queries] int64   (query i sits at position seq_lens[i] - 1)
//   seq_ids      [num_queries] int64   (query i's sequence: its block table row; empty: row i)
//   -> out       [num_queries, num_heads, head_dim]
//
// Scores, softmax and the weighted sum are accumulated in float32. A
// logit_softcap c > 0 (Gemma 2) maps each scaled score s to c * tanh(s / c)
// before the softmax, in float32, as the torch reference does. sinks
// [num_heads] float32 (gpt-oss; empty: none): a logit per head in the
// softmax's max and sum, with no value (its probability is dropped), as the
// torch reference's (model/attention.py _softmax). With sinks the prefill
// tiles and the AVX2 kernels stand aside (the decode kernels, the scalar one).
// An 8-bit cache (q8_0, fp8) is read in its stored format by the generic
// AVX-512 kernel (or the scalar one), each value d * q in float32 as
// kv_format.h's kv_decode: the same numbers as the dequantized reference.
//
// Every query sums the same way whichever step or chunk it comes in (batch
// invariance), except one opt-out: with prefill_tiles, in bfloat16 on
// AVX512-BF16, the queries of a prefill chunk (2 tokens or more of one request
// at consecutive positions, no sliding window) go in tiles of 16 with the
// queries in vector lanes (prefill_tile_bf16): K and V read once for the tile
// and no horizontal sums, but the dot products and the softmax's sum run in
// another order than a decode's, so a recomputed or re-chunked prompt may
// round otherwise (TOKENMILL_BATCH_INVARIANT=0 turns the tiles on). Threads
// take ranges of equal work (a query costs its context), not of equal query
// counts.
#include <torch/extension.h>

#include "kv_format.h"
#include "kv_prefetch.h"
#include "no_gil.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include <omp.h>
#include <vector>

// Rows of the cache are converted to float32 into a small buffer first, so the
// dot products and sums below run on plain floats (vectorised). bfloat16 is the
// top half of a float32: the conversion is a 16-bit shift.
// Gemma 2's logit soft-cap on n scaled scores in place: s = cap * tanh(s / cap),
// in float32, before the softmax (HF's order); cap 0: none (fused_ops.cpp).
void softcap_scores(float* s, int64_t n, float cap);

// What the softmax adds to the scores: the soft-cap (0: none) and the sinks (null: none).
struct ScoreMods {
  float softcap;
  const float* sinks;
};

// The softmax's sum (of exp(s - m), m the scores' max) with head's sink taken
// in: exp(s - m) / (sum + exp(sink - m)) is the softmax over the scores and the
// sink, the sink's own share dropped.
static inline float with_sink(const ScoreMods& mods, int64_t head, float m, float sum) {
  return mods.sinks ? sum + std::exp(mods.sinks[head] - m) : sum;
}

static inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
static inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename scalar_t>
static void paged_attention_impl(const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              double scale, int64_t sliding_window, ScoreMods mods, const at::Tensor& seq_ids, at::Tensor& out) {
  const int64_t num_decodes = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  // The cache in bytes, any stored format (kv_format.h): a token's row holds every KV head.
  const KvFormat fmt = kv_format_of(kv_cache);
  const int64_t row_values = num_kv_heads * head_dim;
  const int64_t row_bytes = num_kv_heads * kv_entry_bytes(fmt, head_dim, sizeof(scalar_t));
  const int64_t block_bytes = block_size * row_bytes;
  const int64_t kv_bytes = num_blocks * block_bytes;  // K -> V

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t q_row = q.stride(0);  // q may be a view of wider rows
  const uint8_t* k_base = static_cast<const uint8_t*>(kv_cache.data_ptr());
  const uint8_t* v_base = k_base + kv_bytes;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* seq = seq_ids.numel() ? seq_ids.data_ptr<int64_t>() : nullptr;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  // One request per task: its blocks are swept in order, all heads of a token
  // together, so every cache line of K and V is read once.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < num_decodes; ++b) {
    const int64_t seq_len = lens[b];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
    const int64_t n = seq_len - first;
    std::vector<float> qf(num_heads * head_dim), scores(num_heads * n), acc(num_heads * head_dim, 0.f);
    std::vector<float> row(row_values);
    to_float(q_ptr + b * q_row, qf.data(), num_heads * head_dim);
    for (float& x : qf) x *= fscale;
    auto token = [&](const uint8_t* base, int64_t t) {
      return base + bt[(seq ? seq[b] : b) * max_blocks + t / block_size] * block_bytes + (t % block_size) * row_bytes;
    };
    // scores[head][t] = q_head . k_{kv head of head}[t]
    for (int64_t t = first; t < seq_len; ++t) {
      kv_decode<scalar_t>(fmt, token(k_base, t), row.data(), row_values);
      for (int64_t head = 0; head < num_heads; ++head)
        scores[head * n + (t - first)] =
            dot(&qf[head * head_dim], &row[(head / group) * head_dim], head_dim);
    }
    softcap_scores(scores.data(), num_heads * n, mods.softcap);
    for (int64_t head = 0; head < num_heads; ++head) {  // softmax, in float32
      float* sh = &scores[head * n];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) m = std::max(m, sh[i]);
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) { sh[i] = std::exp(sh[i] - m); sum += sh[i]; }
      const float inv = 1.f / with_sink(mods, head, m, sum);
      for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
    }
    for (int64_t t = first; t < seq_len; ++t) {  // acc[head] += p[head][t] * v[t]
      kv_decode<scalar_t>(fmt, token(v_base, t), row.data(), row_values);
      for (int64_t head = 0; head < num_heads; ++head)
        axpy(scores[head * n + (t - first)], &row[(head / group) * head_dim], &acc[head * head_dim],
             head_dim);
    }
    for (int64_t i = 0; i < num_heads * head_dim; ++i)
      out_ptr[b * num_heads * head_dim + i] = static_cast<scalar_t>(acc[i]);
  }
}

// ---------------------------------------------------------------------------
// AVX-512 path: one task per request, its heads one after another. Scores for 16 tokens at a time are
// 16 vector dot products folded into one vector by a transpose-add tree (no
// per-token horizontal sum); exp is vectorised; the weighted sum of V keeps its
// accumulators in registers (head_dim / 16 vectors per head).
#if defined(__AVX512F__)
#include "cpu_vec.h"


// A plain cache's 16 values (the loader of a cache in the model's dtype; kv_format.h has the others).
template <typename T>
struct KvPlainLoad {
  static constexpr KvFormat format = KvFormat::kPlain;
  static inline __m512 load(const uint8_t* head, int c) { return load16(reinterpret_cast<const T*>(head) + 16 * c); }
};

template <typename scalar_t, typename KV, int C>  // C = head_dim / 16; KV: the cache's loader
static void paged_attention_avx512(const at::Tensor& q, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                double scale, int64_t sliding_window, ScoreMods mods, const at::Tensor& seq_ids, at::Tensor& out) {
  constexpr int64_t head_dim = 16 * C;
  const int64_t num_decodes = q.size(0), num_heads = q.size(1);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  // In bytes: a head's entry, a token's row (every KV head), a block, K -> V.
  const int64_t entry_bytes = kv_entry_bytes(KV::format, head_dim, sizeof(scalar_t));
  const int64_t row_bytes = num_kv_heads * entry_bytes;
  const int64_t block_bytes = block_size * row_bytes;
  const int64_t kv_bytes = num_blocks * block_bytes;

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t q_row = q.stride(0);  // q may be a view of wider rows
  const uint8_t* k_base = static_cast<const uint8_t*>(kv_cache.data_ptr());
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* seq = seq_ids.numel() ? seq_ids.data_ptr<int64_t>() : nullptr;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  // One task per request: its K/V (all KV heads) stays in this core's cache
  // while the KV heads are processed one after another. No software prefetch
  // (docs/perf-notes.md: what was tried). Fewer requests than threads (one
  // stream): a task per KV head of each request instead, so every core works;
  // a head's sums are the same either way (the same bits).
  const int64_t kv_per_task = num_decodes < omp_get_max_threads() ? 1 : num_kv_heads;
  const int64_t tasks_per_query = num_kv_heads / kv_per_task;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<const uint8_t*> rows;  // start of the K row (all KV heads) of each context token
    int64_t rows_of = -1;  // the query rows holds
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_decodes * tasks_per_query; ++task) {
      const int64_t b = task / tasks_per_query, kvh0 = task % tasks_per_query * kv_per_task;
      const int64_t seq_len = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t n = seq_len - first;
      const int64_t n_pad = (n + 15) & ~int64_t(15);
      scores.resize(n_pad);
      if (rows_of != b) {
        rows.resize(n);
        for (int64_t t = first; t < seq_len; ++t)
          rows[t - first] = k_base + bt[(seq ? seq[b] : b) * max_blocks + t / block_size] * block_bytes +
                            (t % block_size) * row_bytes;
        rows_of = b;
      }
      for (int64_t head = kvh0 * group; head < (kvh0 + kv_per_task) * group; ++head) {
        const int64_t kv_off = (head / group) * entry_bytes;
        const scalar_t* qh = q_ptr + b * q_row + head * head_dim;
        __m512 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_mul_ps(load16(qh + 16 * c), vscale);
        float* s = scores.data();
        // Scores, 16 tokens at a time.
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
          const int64_t cnt = std::min<int64_t>(16, n - t0);
          __m512 acc[16];
          for (int64_t j = 0; j < 16; ++j) {
            __m512 a = _mm512_setzero_ps();
            if (j < cnt) {
              const uint8_t* kr = rows[t0 + j] + kv_off;
              for (int c = 0; c < C; ++c) a = _mm512_fmadd_ps(qv[c], KV::load(kr, c), a);
            }
            acc[j] = a;
          }
          _mm512_storeu_ps(s + t0, hsum16(acc));
        }
        softcap_scores(s, n, mods.softcap);
        // Softmax (in float32): padding lanes get -inf, so exp gives 0.
        for (int64_t i = n; i < n_pad; ++i) s[i] = -std::numeric_limits<float>::infinity();
        __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t i = 0; i < n_pad; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
        const float mx = _mm512_reduce_max_ps(vmax);
        const __m512 m = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n_pad; i += 16) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
          _mm512_storeu_ps(s + i, e);
          vsum = _mm512_add_ps(vsum, e);
        }
        const float inv = 1.f / with_sink(mods, head, mx, _mm512_reduce_add_ps(vsum));
        // out = sum_t p_t v_t / sum, accumulators in registers.
        __m512 o[C];
        for (int c = 0; c < C; ++c) o[c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; ++t) {
          const uint8_t* vr = rows[t] + kv_bytes + kv_off;
          const __m512 p = _mm512_set1_ps(s[t]);
          for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(p, KV::load(vr, c), o[c]);
        }
        alignas(64) float res[head_dim];
        for (int c = 0; c < C; ++c) _mm512_store_ps(res + 16 * c, _mm512_mul_ps(o[c], _mm512_set1_ps(inv)));
        scalar_t* oh = out_ptr + (b * num_heads + head) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) oh[i] = static_cast<scalar_t>(res[i]);
      }
    }
  }
}

#if defined(__AVX512BF16__)
// Scores of HC heads (one KV head's) for 8 keys at a time, queries in lanes:
// s[h][t] lane i = sum over pairs p of q_i,h pair p . k_t pair p (vdpbf16ps of
// the queries' pair p, transposed once a tile, times key t's pair broadcast).
template <int HC, int PD>
static inline void tile_scores(const uint32_t* qt,  // [HC][PD][16]: the heads' pairs, lanes = queries
                               const at::BFloat16* const* rows, int64_t kv_off, int64_t n8,
                               const __m512 vscale, float* s, int64_t s_head) {
  for (int64_t t0 = 0; t0 < n8; t0 += 8) {
    __m512 acc[HC][8];
    for (int h = 0; h < HC; ++h)
      for (int j = 0; j < 8; ++j) acc[h][j] = _mm512_setzero_ps();
    const uint32_t* k[8];
    for (int j = 0; j < 8; ++j) k[j] = reinterpret_cast<const uint32_t*>(rows[t0 + j] + kv_off);
    for (int p = 0; p < PD; ++p) {
      __m512bh qv[HC];
      for (int h = 0; h < HC; ++h) qv[h] = (__m512bh)_mm512_loadu_si512(qt + (h * PD + p) * 16);
      for (int j = 0; j < 8; ++j) {
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(k[j][p]));
        for (int h = 0; h < HC; ++h) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], qv[h], kb);
      }
    }
    for (int h = 0; h < HC; ++h)
      for (int j = 0; j < 8; ++j) _mm512_storeu_ps(s + h * s_head + (t0 + j) * 16, _mm512_mul_ps(acc[h][j], vscale));
  }
}

// Attention of up to 16 consecutive queries of one request at consecutive
// positions (part of a prefill chunk), no sliding window: every K and V row is
// read once for all of them, and no horizontal sums. Queries sit in lanes for
// the scores and the softmax (which runs down the keys, 16 queries at a time);
// the weighted sum of V is the decode kernel's (two keys an instruction, dims
// in lanes). Query i sees keys t < lens[b0 + i]; the rest of its lane is -inf.
// Each query's numbers depend on its own q and context only, not on which
// queries share its tile. Probabilities are normalised, then rounded to bf16,
// as in the decode kernel; the dot products sum in another order than there.
template <int C>
static void prefill_tile_bf16(const at::BFloat16* q_ptr, int64_t q_row, int64_t b0, int64_t nq,
                              const int64_t* lens, const at::BFloat16* const* rows,  // n rows + padding to a multiple of 8 (+1)
                              int64_t kv_stride, int64_t num_heads, int64_t num_kv_heads, __m512 vscale, float softcap,
                              __m512i ilo, __m512i ihi, at::BFloat16* out_ptr, std::vector<uint32_t>& qt,
                              std::vector<float>& scores, std::vector<uint32_t>& probs,
                              std::vector<__m512i>& vbuf) {
  constexpr int64_t D = 16 * C, PD = D / 2, P = C / 2;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t n = lens[b0 + nq - 1], first_len = lens[b0];
  const int64_t n8 = (n + 7) & ~int64_t(7), npairs = (n + 1) / 2;
  qt.assign(num_heads * PD * 16, 0u);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < num_heads; ++h) {
      const uint32_t* qi = reinterpret_cast<const uint32_t*>(q_ptr + (b0 + i) * q_row + h * D);
      for (int64_t p = 0; p < PD; ++p) qt[(h * PD + p) * 16 + i] = qi[p];
    }
  const int64_t s_head = n8 * 16;
  scores.resize(num_heads * s_head);
  probs.resize(num_heads * npairs * 16);
  vbuf.resize(npairs * C);
  // Lane i's key limit, and a lane mask of the queries that see key t.
  alignas(64) int32_t lim[16];
  for (int i = 0; i < 16; ++i) lim[i] = i < nq ? static_cast<int32_t>(lens[b0 + i]) : 0;
  const __m512i vlim = _mm512_load_si512(lim);
  const __mmask16 real = static_cast<__mmask16>((1u << nq) - 1);
  alignas(64) int16_t pair_idx[32];  // [0 16 1 17 ...]: words i and 16 + i side by side
  for (int i = 0; i < 16; ++i) {
    pair_idx[2 * i] = static_cast<int16_t>(i);
    pair_idx[2 * i + 1] = static_cast<int16_t>(16 + i);
  }
  const __m512i ipair = _mm512_load_si512(pair_idx);
  for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
    const int64_t kv_off = kvh * D, h0 = kvh * group;
    for (int64_t g = 0; g < group; g += 3) {
      const int64_t hc = std::min<int64_t>(3, group - g);
      const uint32_t* q0 = qt.data() + (h0 + g) * PD * 16;
      float* s0 = scores.data() + (h0 + g) * s_head;
      if (hc == 3) tile_scores<3, PD>(q0, rows, kv_off, n8, vscale, s0, s_head);
      else if (hc == 2) tile_scores<2, PD>(q0, rows, kv_off, n8, vscale, s0, s_head);
      else tile_scores<1, PD>(q0, rows, kv_off, n8, vscale, s0, s_head);
    }
    softcap_scores(scores.data() + h0 * s_head, group * s_head, softcap);
    // Softmax down the keys, per head, 16 queries at a time; masked lanes -inf
    // (exp gives 0 after rounding), lanes past nq 0 (finite, never stored).
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t h = h0; h < h0 + group; ++h) {
      float* s = scores.data() + h * s_head;
      __m512 vmax = ninf;
      for (int64_t t = 0; t < n; ++t) {
        __m512 x = _mm512_loadu_ps(s + t * 16);
        if (t >= first_len) {
          const __mmask16 sees = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(static_cast<int>(t)));
          x = _mm512_mask_blend_ps(sees, ninf, x);
        }
        x = _mm512_mask_blend_ps(real, _mm512_setzero_ps(), x);
        _mm512_storeu_ps(s + t * 16, x);
        vmax = _mm512_max_ps(vmax, x);
      }
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t * 16), vmax));
        _mm512_storeu_ps(s + t * 16, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), vsum);
      // Pairs (p_t, p_t+1) of each query, as bf16 words side by side: lane i of
      // probs[h][t / 2] is query i's pair (p_n = 0 past the last key).
      uint32_t* pr = probs.data() + h * npairs * 16;
      for (int64_t tp = 0; tp < npairs; ++tp) {
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(s + 2 * tp * 16), inv);
        const __m512 b = 2 * tp + 1 < n ? _mm512_mul_ps(_mm512_loadu_ps(s + (2 * tp + 1) * 16), inv)
                                        : _mm512_setzero_ps();
        // cvtne2ps: words 0-15 from a (p_t), 16-31 from b (p_t+1); interleave them.
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(pr + tp * 16, _mm512_permutexvar_epi16(ipair, w));
      }
    }
    // V rows t, t+1 interleaved element by element, once for all the heads and queries.
    for (int64_t tp = 0; tp < npairs; ++tp) {
      const at::BFloat16* v0 = rows[2 * tp] + kv_stride + kv_off;
      const at::BFloat16* v1 = rows[2 * tp + 1] + kv_stride + kv_off;
      for (int c = 0; c < P; ++c) {
        const __m512i x = _mm512_loadu_si512(v0 + 32 * c), y = _mm512_loadu_si512(v1 + 32 * c);
        vbuf[tp * C + 2 * c] = _mm512_permutex2var_epi16(x, ilo, y);
        vbuf[tp * C + 2 * c + 1] = _mm512_permutex2var_epi16(x, ihi, y);
      }
    }
    // out[i][h] = sum_t p_i,h,t v_t, four queries at a time (4 x C accumulators).
    for (int64_t h = h0; h < h0 + group; ++h) {
      const uint32_t* pr = probs.data() + h * npairs * 16;
      for (int64_t i0 = 0; i0 < nq; i0 += 4) {
        const int64_t qc = std::min<int64_t>(4, nq - i0);
        __m512 o[4][C];
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < C; ++c) o[i][c] = _mm512_setzero_ps();
        for (int64_t tp = 0; tp < npairs; ++tp) {
          __m512bh vi[C];
          for (int c = 0; c < C; ++c) vi[c] = (__m512bh)vbuf[tp * C + c];
          for (int i = 0; i < 4; ++i) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[tp * 16 + i0 + i]));
            for (int c = 0; c < C; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], pp, vi[c]);
          }
        }
        for (int64_t i = 0; i < qc; ++i) {
          at::BFloat16* oh = out_ptr + ((b0 + i0 + i) * num_heads + h) * D;
          for (int c = 0; c < C; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(oh + 16 * c), (__m256i)_mm512_cvtneps_pbh(o[i][c]));
        }
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 with AVX512-BF16: dot products straight on bf16 pairs (vdpbf16ps,
// float32 accumulation), no conversion of K or V. The weighted sum takes two
// tokens per instruction: V rows t and t+1 interleaved element by element,
// times the pair (p_t, p_t+1) of probabilities rounded to bf16 (as the torch
// code rounds them before its matmul). The scores of up to 3 query heads that
// share a KV head come from one pass over K (group_scores: each K row loaded
// once for all of them; the same bits as one head a pass).

// Scores of GC query heads of one KV head over the context (rows), K read once
// for all of them: 8 keys at a time, GC x 8 accumulators. s[g * n_pad + t].
template <int P, int GC, typename Prefetch>
static inline void group_scores(const at::BFloat16* const* rows, int64_t n, int64_t n_pad, int64_t kv_off,
                                const at::BFloat16* q0, int64_t head_dim, float* s, __m256 vscale,
                                Prefetch&& prefetch) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    prefetch(t0);
    __m512 acc[GC][8];
    for (int64_t j = 0; j < 8; ++j) {
      if (t0 + j < n) {
        const at::BFloat16* kr = rows[t0 + j] + kv_off;
        __m512bh k[P];
        for (int c = 0; c < P; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
        for (int g = 0; g < GC; ++g) {
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < P; ++c)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q0 + g * head_dim + 32 * c), k[c]);
          acc[g][j] = a;
        }
      } else {
        for (int g = 0; g < GC; ++g) acc[g][j] = _mm512_setzero_ps();
      }
    }
    for (int g = 0; g < GC; ++g) _mm256_storeu_ps(s + g * n_pad + t0, _mm256_mul_ps(hsum8(acc[g]), vscale));
  }
}

// out[g] = sum_t p_g,t v_t for the GC query heads (of one KV head) whose
// probabilities sit at p[g * n_pad] (bf16 bits, p_n = 0): each pair of V rows
// (v = rows[t] + v_off) is interleaved once, two tokens an instruction, and
// used by all GC heads; prefetch() every 4 tokens. GC is a template argument
// (group_values below picks it) so that the GC * C accumulators stay in
// registers through the loop: with a runtime head count and a break in the
// head loop (as before), GCC kept them on the stack, a load and a store
// around every vdpbf16ps (perf annotate: the V pass was 34% of the kernel).
// (docs/perf-notes.md has the measurements.)
template <int C, int GC, typename Prefetch>
static inline void head_values(const at::BFloat16* const* rows, int64_t n, int64_t v_off, const uint16_t* p,
                               int64_t n_pad, __m512i ilo, __m512i ihi, at::BFloat16* out, Prefetch& prefetch) {
  constexpr int P = C / 2;
  __m512 o[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 2) {
    if ((t & 3) == 0) prefetch();
    const at::BFloat16* v0 = rows[t] + v_off;
    const at::BFloat16* v1 = rows[t + 1] + v_off;
    __m512bh vi[C];
    for (int c = 0; c < P; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * c), y = _mm512_loadu_si512(v1 + 32 * c);
      vi[2 * c] = (__m512bh)_mm512_permutex2var_epi16(x, ilo, y);
      vi[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(x, ihi, y);
    }
    for (int g = 0; g < GC; ++g) {
      uint32_t pair;  // (p_t, p_t+1)
      std::memcpy(&pair, p + g * n_pad + t, sizeof(pair));
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < C; ++c) o[g][c] = _mm512_dpbf16_ps(o[g][c], pp, vi[c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * 16 * C + 16 * c), (__m256i)_mm512_cvtneps_pbh(o[g][c]));
}

// head_values for gc (1 .. GC) heads.
template <int C, int GC, typename Prefetch>
static inline void group_values(int gc, const at::BFloat16* const* rows, int64_t n, int64_t v_off, const uint16_t* p,
                                int64_t n_pad, __m512i ilo, __m512i ihi, at::BFloat16* out, Prefetch&& prefetch) {
  if (gc == GC) head_values<C, GC>(rows, n, v_off, p, n_pad, ilo, ihi, out, prefetch);
  else if constexpr (GC > 1) group_values<C, GC - 1>(gc, rows, n, v_off, p, n_pad, ilo, ihi, out, prefetch);
}

template <int C>  // C = head_dim / 16, even
static void paged_attention_avx512bf16(const at::Tensor& q, const at::Tensor& kv_cache,
                                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                    double scale, int64_t sliding_window, ScoreMods mods, const at::Tensor& seq_ids, at::Tensor& out,
                                    bool prefill_tiles) {
  using scalar_t = at::BFloat16;
  constexpr int64_t head_dim = 16 * C;
  constexpr int P = C / 2;  // 32-element chunks of a head
  const int64_t num_decodes = q.size(0), num_heads = q.size(1);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t kv_stride = num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t block_stride = block_size * num_kv_heads * head_dim;
  const int64_t row_stride = num_kv_heads * head_dim;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t q_row = q.stride(0);  // q may be a view of wider rows
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* seq = seq_ids.numel() ? seq_ids.data_ptr<int64_t>() : nullptr;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  // Word indices that interleave two 32-word vectors x, y: [x0 y0 x1 y1 ...].
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = i; lo_idx[2 * i + 1] = 32 + i;
    hi_idx[2 * i] = 16 + i; hi_idx[2 * i + 1] = 48 + i;
  }
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t kv_bytes = kv_stride * static_cast<int64_t>(sizeof(scalar_t));  // K row -> its V row

  auto row_of = [&](int64_t b) { return seq ? seq[b] : b; };
  // Whether query b is one of a run of queries of one request at consecutive
  // positions (a prefill chunk of 2 tokens or more): those go in tiles.
  auto follows = [&](int64_t b) {  // query b (> 0) is query b - 1's next position, same request
    return seq[b] == seq[b - 1] && lens[b] == lens[b - 1] + 1;
  };
  auto in_chunk = [&](int64_t b) {
    if (!prefill_tiles || !seq || sliding_window > 0 || mods.sinks) return false;
    return (b > 0 && follows(b)) || (b + 1 < num_decodes && follows(b + 1));
  };
  // rows[t - first] = K row of context token t, for t in [first, last): a division per block, not per token.
  auto fill_rows = [&](const int64_t* table, int64_t first, int64_t last, std::vector<const scalar_t*>& rows) {
    for (int64_t t = first; t < last;) {
      const scalar_t* base = k_base + table[t / block_size] * block_stride;
      for (int64_t off = t % block_size; off < block_size && t < last; ++off, ++t)
        rows[t - first] = base + off * row_stride;
    }
  };

  // Each thread takes a contiguous range of queries, and while it computes one
  // (mostly from its L2 cache after the first pass over K) it prefetches the
  // next query's K/V rows from memory: a row per 8 keys of each score pass and
  // a row per 4 tokens of each V pass, spread over the whole query: the
  // hardware's prefetchers alone do not keep up (docs/perf-notes.md).
  //
  // Fewer queries than threads (a decode step of one request on two cores):
  // each thread takes every query but only its share of the KV heads, so the
  // other threads do not wait through a query read by one core's misses in
  // flight. A head's sums are computed the same way either way: the same bits.
  bool split_heads = num_kv_heads > 1 && num_decodes < omp_get_max_threads();
  for (int64_t b = 1; b < num_decodes && split_heads; ++b)
    split_heads = !in_chunk(b);  // (no prefill tiles: they take all heads)
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<uint16_t> probs;  // bf16 bits, padded to an even count
    std::vector<const scalar_t*> rows;
    // Prefill tiles' buffers.
    std::vector<uint32_t> qt, tile_probs;
    std::vector<float> tile_scores;
    std::vector<__m512i> vbuf;
    // Contiguous ranges of queries of about equal work (kv_prefetch.h).
    int64_t lo = 0, hi = 0;
    query_range(lens, num_decodes, sliding_window, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    int64_t kvh_lo = 0, kvh_hi = num_kv_heads;  // the KV heads this thread takes
    if (split_heads) {
      const int64_t t = omp_get_thread_num(), nth = omp_get_num_threads();
      lo = 0;
      hi = num_decodes;
      kvh_lo = t * num_kv_heads / nth;
      kvh_hi = (t + 1) * num_kv_heads / nth;
    }
    // The part of a context row (K, and V at kv_bytes) that this thread's heads read.
    const int64_t head_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t own_off = kvh_lo * head_bytes, own_bytes = (kvh_hi - kvh_lo) * head_bytes;
    int64_t pf_t = 0, pf_end = 0;  // next query's tokens [pf_t, pf_end) not yet prefetched
    int64_t pf_blk = 0, pf_off = 0;  // pf_t's block (in the table) and offset in it
    const int64_t* pf_table = nullptr;
    auto prefetch_rows = [&](int64_t count) {
      for (; count > 0 && pf_t < pf_end; --count, ++pf_t) {  // (no division per row: ~40 cycles each)
        const char* k = reinterpret_cast<const char*>(k_base + pf_table[pf_blk] * block_stride + pf_off * row_stride);
        if (++pf_off == block_size) {
          pf_off = 0;
          ++pf_blk;
        }
        prefetch_kv_row<_MM_HINT_T1>(k, kv_bytes, row_bytes);
      }
    };
    for (int64_t b = lo; b < hi; ++b) {
      if (in_chunk(b)) {  // up to 16 queries of this chunk in one tile
        int64_t e = b + 1;
        while (e < hi && e - b < 16 && follows(e)) ++e;
        const int64_t n = lens[e - 1], n_rows = std::max<int64_t>((n + 7) & ~int64_t(7), n + 1);
        rows.resize(n_rows);
        fill_rows(bt + seq[b] * max_blocks, 0, n, rows);
        for (int64_t t = n; t < n_rows; ++t) rows[t] = rows[n - 1];
        prefill_tile_bf16<C>(q_ptr, q_row, b, e - b, lens, rows.data(), kv_stride, num_heads, num_kv_heads,
                             vscale, mods.softcap, ilo, ihi, out_ptr, qt, tile_scores, tile_probs, vbuf);
        pf_table = nullptr;  // the next query prefetches for itself
        b = e - 1;
        continue;
      }
      const int64_t seq_len = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t n = seq_len - first;
      const int64_t n_pad = (n + 15) & ~int64_t(15);
      scores.resize(group * n_pad);
      probs.resize(group * n_pad);
      rows.resize(n + 1);
      fill_rows(bt + row_of(b) * max_blocks, first, seq_len, rows);
      rows[n] = rows[n - 1];  // the odd token's partner: a real row times probability 0
      const bool prefetched = b > lo && pf_table != nullptr;  // by the previous query
      pf_table = nullptr;
      pf_t = pf_end = 0;
      if (b + 1 < hi && row_of(b + 1) != row_of(b)) {  // same request: its rows are cached
        pf_table = bt + row_of(b + 1) * max_blocks;
        pf_end = lens[b + 1];
        pf_t = sliding_window > 0 ? std::max<int64_t>(0, pf_end - sliding_window) : 0;
        pf_blk = pf_t / block_size;
        pf_off = pf_t % block_size;
      }
      if (!prefetched)
        for (int64_t j = 0; j < std::min<int64_t>(16, n); ++j)
          prefetch_kv_row<_MM_HINT_T0>(reinterpret_cast<const char*>(rows[j]) + own_off, kv_bytes, own_bytes);
      for (int64_t kvh = kvh_lo; kvh < kvh_hi; ++kvh) {
        const int64_t kv_off = kvh * head_dim;
        // Scores of every query head that reads this KV head, up to 3 heads a pass over K.
        for (int64_t g0 = 0; g0 < group; g0 += 3) {
          const int64_t gc = std::min<int64_t>(3, group - g0);
          const scalar_t* q0 = q_ptr + b * q_row + (kvh * group + g0) * head_dim;
          float* s0 = scores.data() + g0 * n_pad;
          auto pf = [&](int64_t t0) {
            prefetch_rows(1);
            if (kvh == kvh_lo && g0 == 0 && !prefetched && (t0 & 15) == 0)  // the next 16 tokens' rows, own heads
              for (int64_t j = t0 + 16; j < std::min(t0 + 32, n); ++j)
                prefetch_kv_row<_MM_HINT_T0>(reinterpret_cast<const char*>(rows[j]) + own_off, kv_bytes, own_bytes);
          };
          const __m256 vs8 = _mm512_castps512_ps256(vscale);
          if (gc == 3) group_scores<P, 3>(rows.data(), n, n_pad, kv_off, q0, head_dim, s0, vs8, pf);
          else if (gc == 2) group_scores<P, 2>(rows.data(), n, n_pad, kv_off, q0, head_dim, s0, vs8, pf);
          else group_scores<P, 1>(rows.data(), n, n_pad, kv_off, q0, head_dim, s0, vs8, pf);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * n_pad;
          softcap_scores(s, n, mods.softcap);
          for (int64_t i = n; i < n_pad; ++i) s[i] = -std::numeric_limits<float>::infinity();
          __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (int64_t i = 0; i < n_pad; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
          const float mx = _mm512_reduce_max_ps(vmax);
          const __m512 m = _mm512_set1_ps(mx);
          __m512 vsum = _mm512_setzero_ps();
          for (int64_t i = 0; i < n_pad; i += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
            _mm512_storeu_ps(s + i, e);
            vsum = _mm512_add_ps(vsum, e);
          }
          const __m512 inv = _mm512_set1_ps(1.f / with_sink(mods, kvh * group + g, mx, _mm512_reduce_add_ps(vsum)));
          uint16_t* pg = probs.data() + g * n_pad;
          for (int64_t i = 0; i < n_pad; i += 16)  // normalised, then rounded to bf16
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + i), inv)));
        }
        // out[head] = sum_t p_head,t v_t, up to 16 / C heads a pass over V.
        constexpr int G = 16 / C;
        for (int64_t g0 = 0; g0 < group; g0 += G)
          group_values<C, G>(static_cast<int>(std::min<int64_t>(G, group - g0)), rows.data(), n,
                             kv_stride + kv_off, probs.data() + g0 * n_pad, n_pad, ilo, ihi,
                             out_ptr + (b * num_heads + kvh * group + g0) * head_dim, [&] { prefetch_rows(1); });
      }
    }
  }
}
#endif

// The generic AVX-512 kernel for head_dim, with the cache's loader KV.
template <typename scalar_t, typename KV>
static bool avx512_any(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, double scale, int64_t sliding_window, ScoreMods mods,
                       const at::Tensor& seq_ids, at::Tensor& out) {
  switch (q.size(2)) {
    case 16: paged_attention_avx512<scalar_t, KV, 1>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out); return true;
    case 32: paged_attention_avx512<scalar_t, KV, 2>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out); return true;
    case 64: paged_attention_avx512<scalar_t, KV, 4>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out); return true;
    case 128: paged_attention_avx512<scalar_t, KV, 8>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out); return true;
    case 256: paged_attention_avx512<scalar_t, KV, 16>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out); return true;
    default: return false;
  }
}

template <typename scalar_t>
static bool paged_attention_fast(const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              double scale, int64_t sliding_window, ScoreMods mods, const at::Tensor& seq_ids, at::Tensor& out,
                              [[maybe_unused]] bool prefill_tiles) {
  // An 8-bit cache: the generic kernel, reading the stored format (no dequantized copy).
  switch (kv_format_of(kv_cache)) {
    case KvFormat::kQ8_0: return avx512_any<scalar_t, KvQ8Load>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out);
    case KvFormat::kFp8E4M3: return avx512_any<scalar_t, KvE4M3Load>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out);
    case KvFormat::kFp8E5M2: return avx512_any<scalar_t, KvE5M2Load>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out);
    case KvFormat::kPlain: break;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    switch (q.size(2)) {
      case 32: paged_attention_avx512bf16<2>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out, prefill_tiles); return true;
      case 64: paged_attention_avx512bf16<4>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out, prefill_tiles); return true;
      case 128: paged_attention_avx512bf16<8>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out, prefill_tiles); return true;
      case 256: paged_attention_avx512bf16<16>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out, prefill_tiles); return true;
      default: break;
    }
  }
#endif
  return avx512_any<scalar_t, KvPlainLoad<scalar_t>>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out);
}
#elif defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------------------
// AVX2 path (e.g. Zen 3), one task per request: scores for 8 tokens at a time,
// folded into one vector by horizontal adds; exp vectorised; the context's
// rows read in address order (rows_avx2).
#include <immintrin.h>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// r[j] = sum of the lanes of v[j], j = 0..7.
static inline __m256 hsum8x8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // halves: v0-3, v4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

static inline float hadd8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// exp(x) for x <= 0 (scores minus their max), as exp16 in cpu_vec.h; 2^n through
// the exponent bits (n >= -127: 2^-127 comes out as 0).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Softmax of one score row in place, in float32 (the padding lanes get -inf,
// so exp gives 0 there); returns 1 / the sum.
static inline float softmax_row(float* sg, int64_t n, int64_t n_pad, float softcap) {
  softcap_scores(sg, n, softcap);
  for (int64_t i = n; i < n_pad; ++i) sg[i] = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n_pad; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + i));
  const __m256 m = _mm256_set1_ps(hmax8(vmax));
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n_pad; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m));
    _mm256_storeu_ps(sg + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return 1.f / hadd8(vsum);
}

// d[g] = the lanes of G query heads' dot products (qs, pre-scaled, D floats a
// head) with one KV head's key kr, before their horizontal sum: even and odd
// 8-lane chunks in two accumulators, added at the end. kr null: zeros (a
// padding token). Both kernels below score through this, so their bits agree.
template <typename scalar_t, int C, int G>
static inline void key_dots(const scalar_t* kr, const float* qs, __m256 (&d)[G]) {
  constexpr int64_t D = 8 * C;
  __m256 a0[G], a1[G];
  for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
  if (kr)
    for (int c = 0; c < C; ++c) {
      const __m256 k = load8(kr + 8 * c);
      for (int g = 0; g < G; ++g) {
        if (c % 2) a1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + 8 * c), k, a1[g]);
        else a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + 8 * c), k, a0[g]);
      }
    }
  for (int g = 0; g < G; ++g) d[g] = _mm256_add_ps(a0[g], a1[g]);
}

// The G query heads of one KV head (GQA) of one query, together, in passes
// over the context: scores, then the weighted sum CH outputs at a time.
// rows: the request's K rows; s: G score rows of n_pad; qs: G pre-scaled
// query heads; res: G output heads. For groups of more than 4 query heads a
// KV head; rows_avx2 below takes the others (it is faster where both apply).
template <typename scalar_t, int C, int G>
static inline void heads_avx2(const scalar_t* const* rows, int64_t n, int64_t n_pad, int64_t kv_off,
                              int64_t kv_stride, const float* qs, float* s, float* res, float softcap) {
  constexpr int64_t D = 8 * C;
  for (int64_t t0 = 0; t0 < n; t0 += 8) {  // scores, 8 tokens at a time
    const int64_t cnt = std::min<int64_t>(8, n - t0);
    __m256 acc[G][8];
    for (int64_t j = 0; j < 8; ++j) {
      __m256 d[G];
      key_dots<scalar_t, C, G>(j < cnt ? rows[t0 + j] + kv_off : nullptr, qs, d);
      for (int g = 0; g < G; ++g) acc[g][j] = d[g];
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(s + g * n_pad + t0, hsum8x8(acc[g]));
  }
  __m256 inv[G];
  for (int g = 0; g < G; ++g) inv[g] = _mm256_set1_ps(softmax_row(s + g * n_pad, n, n_pad, softcap));
  // out = sum_t p_t v_t / sum: CH vectors of each head's output at a time in registers.
  constexpr int CH = G <= 3 ? 4 : 2;
  static_assert(C % CH == 0, "head_dim / 8 a multiple of the chunk");
  for (int c0 = 0; c0 < C; c0 += CH) {
    __m256 o[G][CH];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) o[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* vr = rows[t] + kv_stride + kv_off + 8 * c0;
      __m256 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(s + g * n_pad + t);
      for (int c = 0; c < CH; ++c) {
        const __m256 v = load8(vr + 8 * c);
        for (int g = 0; g < G; ++g) o[g][c] = _mm256_fmadd_ps(p[g], v, o[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(res + g * D + 8 * (c0 + c), _mm256_mul_ps(o[g][c], inv[g]));
  }
}

// One query, every head (up to G = 4 query heads a KV head), each context
// row read front to back, all KV heads, in address order: token t's K row
// gives its score for every head (8 tokens' vectors wait in buf for one
// hsum8x8 a head; inv: a float a head), then, after the softmax, its V row is added into every
// head's accumulators (acc, in L1). The same operations per head, in the same
// order, as heads_avx2: the same bits.
//
// Address order is what pays: each row read front to back streams about
// twice as fast as per-head passes over parts of it (docs/perf-notes.md: the
// measurements, and what was tried and not kept).
template <typename scalar_t, int C, int G>
static void rows_avx2(const scalar_t* const* rows, int64_t n, int64_t n_pad, int64_t kvh_n, int64_t kv_stride,
                      const float* qs, float* s, float* acc, float* buf, float* inv, float softcap) {
  constexpr int64_t D = 8 * C;
  const int64_t H = kvh_n * G;
  // Scores: buf[j * H + h] holds token t0 + j's vector for head h until the
  // 8 of them are folded (hsum8x8) into s[h * n_pad + t0 ..].
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t cnt = std::min<int64_t>(8, n - t0);
    for (int64_t j = 0; j < 8; ++j) {
      for (int64_t kvh = 0; kvh < kvh_n; ++kvh) {
        __m256 d[G];
        key_dots<scalar_t, C, G>(j < cnt ? rows[t0 + j] + kvh * D : nullptr, qs + kvh * G * D, d);
        for (int g = 0; g < G; ++g) _mm256_storeu_ps(buf + 8 * (j * H + kvh * G + g), d[g]);
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      __m256 v[8];
      for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(buf + 8 * (j * H + h));
      _mm256_storeu_ps(s + h * n_pad + t0, hsum8x8(v));
    }
  }
  for (int64_t h = 0; h < H; ++h) inv[h] = softmax_row(s + h * n_pad, n, n_pad, softcap);
  // Weighted sum: acc[h * D ..] += p[h][t] v_t, token by token.
  constexpr int CH = G <= 3 ? 4 : 2;
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t kvh = 0; kvh < kvh_n; ++kvh) {
      const scalar_t* vr = rows[t] + kv_stride + kvh * D;
      __m256 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(s + (kvh * G + g) * n_pad + t);
      for (int c0 = 0; c0 < C; c0 += CH) {
        float* a = acc + kvh * G * D + 8 * c0;
        for (int c = 0; c < CH; ++c) {
          const __m256 v = load8(vr + 8 * (c0 + c));
          for (int g = 0; g < G; ++g)
            _mm256_storeu_ps(a + g * D + 8 * c, _mm256_fmadd_ps(p[g], v, _mm256_loadu_ps(a + g * D + 8 * c)));
        }
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const __m256 iv = _mm256_set1_ps(inv[h]);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(acc + h * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + 8 * c), iv));
  }
}

template <typename scalar_t, int C>  // C = head_dim / 8
static void paged_attention_avx2(const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              double scale, int64_t sliding_window, float softcap, const at::Tensor& seq_ids, at::Tensor& out) {
  constexpr int64_t head_dim = 8 * C;
  constexpr int GM = 4;  // query heads of a KV head taken together (more: in turns)
  const int64_t num_decodes = q.size(0), num_heads = q.size(1);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t kv_stride = num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t block_stride = block_size * num_kv_heads * head_dim;
  const int64_t row_stride = num_kv_heads * head_dim;

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t q_row = q.stride(0);
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* seq = seq_ids.numel() ? seq_ids.data_ptr<int64_t>() : nullptr;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

#pragma omp parallel
  {
    std::vector<float> scores, qs(GM * head_dim), res(GM * head_dim);
    std::vector<const scalar_t*> rows;
    std::vector<float> rscores, qall(num_heads * head_dim), accall(num_heads * head_dim);
    std::vector<float> rbuf(8 * 8 * num_heads), rinv(num_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_decodes; ++b) {
      const int64_t seq_len = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t n = seq_len - first;
      const int64_t n_pad = (n + 7) & ~int64_t(7);
      scores.resize(GM * n_pad);
      rows.resize(n);
      for (int64_t t = first; t < seq_len; ++t)
        rows[t - first] = k_base + bt[(seq ? seq[b] : b) * max_blocks + t / block_size] * block_stride +
                          (t % block_size) * row_stride;
      if (group <= GM) {
        rscores.resize(num_heads * n_pad);
        const scalar_t* qb = q_ptr + b * q_row;
        for (int64_t i = 0; i < num_heads * head_dim; ++i) qall[i] = static_cast<float>(qb[i]) * fscale;
        const scalar_t* const* r = rows.data();
        float *sp = rscores.data(), *ap = accall.data(), *bp = rbuf.data(), *ip = rinv.data();
        switch (group) {
          case 1: rows_avx2<scalar_t, C, 1>(r, n, n_pad, num_kv_heads, kv_stride, qall.data(), sp, ap, bp, ip, softcap); break;
          case 2: rows_avx2<scalar_t, C, 2>(r, n, n_pad, num_kv_heads, kv_stride, qall.data(), sp, ap, bp, ip, softcap); break;
          case 3: rows_avx2<scalar_t, C, 3>(r, n, n_pad, num_kv_heads, kv_stride, qall.data(), sp, ap, bp, ip, softcap); break;
          default: rows_avx2<scalar_t, C, 4>(r, n, n_pad, num_kv_heads, kv_stride, qall.data(), sp, ap, bp, ip, softcap); break;
        }
        scalar_t* ob = out_ptr + b * num_heads * head_dim;
        for (int64_t i = 0; i < num_heads * head_dim; ++i) ob[i] = static_cast<scalar_t>(accall[i]);
        continue;
      }
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        for (int64_t g0 = 0; g0 < group; g0 += GM) {
          const int gc = static_cast<int>(std::min<int64_t>(GM, group - g0));
          const int64_t h0 = kvh * group + g0;
          const scalar_t* qh = q_ptr + b * q_row + h0 * head_dim;
          for (int64_t i = 0; i < gc * head_dim; ++i) qs[i] = static_cast<float>(qh[i]) * fscale;
          const int64_t kv_off = kvh * head_dim;
          switch (gc) {
            case 1: heads_avx2<scalar_t, C, 1>(rows.data(), n, n_pad, kv_off, kv_stride, qs.data(), scores.data(), res.data(), softcap); break;
            case 2: heads_avx2<scalar_t, C, 2>(rows.data(), n, n_pad, kv_off, kv_stride, qs.data(), scores.data(), res.data(), softcap); break;
            case 3: heads_avx2<scalar_t, C, 3>(rows.data(), n, n_pad, kv_off, kv_stride, qs.data(), scores.data(), res.data(), softcap); break;
            default: heads_avx2<scalar_t, C, 4>(rows.data(), n, n_pad, kv_off, kv_stride, qs.data(), scores.data(), res.data(), softcap); break;
          }
          scalar_t* oh = out_ptr + (b * num_heads + h0) * head_dim;
          for (int64_t i = 0; i < gc * head_dim; ++i) oh[i] = static_cast<scalar_t>(res[i]);
        }
      }
    }
  }
}

template <typename scalar_t>
static bool paged_attention_fast(const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              double scale, int64_t sliding_window, ScoreMods mods, const at::Tensor& seq_ids, at::Tensor& out,
                              bool) {
  // (the scalar kernel takes sinks and 8-bit caches)
  if (mods.sinks || kv_format_of(kv_cache) != KvFormat::kPlain) return false;
  const float softcap = mods.softcap;
  switch (q.size(2)) {
    case 32: paged_attention_avx2<scalar_t, 4>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, softcap, seq_ids, out); return true;
    case 64: paged_attention_avx2<scalar_t, 8>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, softcap, seq_ids, out); return true;
    case 128: paged_attention_avx2<scalar_t, 16>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, softcap, seq_ids, out); return true;
    case 256: paged_attention_avx2<scalar_t, 32>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, softcap, seq_ids, out); return true;
    default: return false;
  }
}
#else
template <typename scalar_t>
static bool paged_attention_fast(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, double, int64_t, ScoreMods, const at::Tensor&, at::Tensor&, bool) {
  return false;
}
#endif

at::Tensor paged_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t sliding_window,
                        at::Tensor seq_ids, bool prefill_tiles, double logit_softcap,
                        const std::optional<at::Tensor>& sinks) {
  NoGil no_gil;
  TORCH_CHECK(logit_softcap >= 0, "paged_attention: logit_softcap > 0, or 0 for none");
  const bool has_sinks = sinks.has_value() && sinks->numel();
  TORCH_CHECK(!has_sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                             sinks->numel() == q.size(1)),
              "paged_attention: sinks [num_heads] float32 contiguous, or none");
  const ScoreMods mods{static_cast<float>(logit_softcap), has_sinks ? sinks->data_ptr<float>() : nullptr};
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_attention runs on the CPU");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() || kv_format_of(kv_cache) != KvFormat::kPlain,
              "kv_cache: q's dtype, or an 8-bit format (kv_format.h)");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, kv_heads, entry]");
  check_kv_entry(kv_cache, q.size(2), "paged_attention");
  // q may be a view of the fused qkv rows: each row's heads contiguous is enough.
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  kv_cache = kv_cache.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(seq_lens.numel() == q.size(0), "one seq_len per query");
  if (seq_ids.numel()) {
    seq_ids = seq_ids.to(at::kLong).contiguous();
    TORCH_CHECK(seq_ids.numel() == q.size(0), "one block table row per query");
    const int64_t* r = seq_ids.data_ptr<int64_t>();
    bool in_range = true;
    for (int64_t i = 0; i < seq_ids.numel(); ++i) in_range &= r[i] >= 0 && r[i] < block_tables.size(0);
    TORCH_CHECK(in_range, "seq_ids out of range");
  } else {
    TORCH_CHECK(block_tables.size(0) >= q.size(0), "a block table row per query");
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    if (!paged_attention_fast<float>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out, prefill_tiles))
      paged_attention_impl<float>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    if (!paged_attention_fast<at::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out,
                                             prefill_tiles))
      paged_attention_impl<at::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, mods, seq_ids, out);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}
