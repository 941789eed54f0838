// y = x W^T (+ bias) in bfloat16 on weights packed once at load time, for any
// number of rows of x (decode steps, mixed steps, prefills).
//
// Packed layout (formats.pack_weight; zero rows pad N to a multiple of 16):
//   packed[b][k/2][j][k%2] = W[16 b + j][k]      shape [ceil(N/16), K/2, 16, 2]
// so one 64-byte vector holds a pair of K for 16 output rows, and block b (16
// outputs, all of K) is one contiguous stretch read front to back: a single
// sequential stream per block that the hardware prefetcher follows. A pair of
// x values broadcast to all lanes times that vector (vdpbf16ps, AVX512-BF16)
// adds to 16 outputs at once: the accumulators hold outputs directly, no
// horizontal sums. Tiles of up to 6 rows of x times 3 blocks (18 float32
// accumulators) reuse each weight vector 6 times and each x pair 3 times.
// packed_gemm_silu: the MLP's gate_up projection with silu(gate) * up done on
// the tile's accumulators (2 (gate, up) pairs a tile: 24 accumulators), so its
// [M, 2 * inter] output is never written.
//
//   x [M, K] bf16 contiguous, packed [ceil(N/16), K/2, 16, 2] bf16, n_out = N,
//   bias [N] bf16 or empty -> y [M, N] bf16, or float32 with float32_out (the
//   logits: no rounding of the sums at all). K must be even.
//
// float32 weights get the same treatment with one K per vector: packed
// [ceil(N/16), K, 16] (packed[b][k][j] = W[16 b + j][k]), x[k] broadcast, FMAs,
// y float32. Built with AVX512-BF16: both dtypes. Built with AVX2 and FMA only
// (e.g. Zen 3): each block of 16 outputs as two 8-lane vectors in tiles of up
// to 6 rows (12 accumulators of the 16 registers; TilePlan), float32 math for both
// dtypes: bf16 weights (the same packed layout) widened to float32 in the
// tile, each bf16 product exact, the pair's odd k added first as vdpbf16ps
// does, so the AVX2 build's bf16 reads half the bytes of float32 at about its
// FLOP rate (torch's own bf16 matmul is far slower there).
//
// Every output is its row's sum over k in order, one FMA a k, whatever the
// number of rows M or the tile a row falls in: a row's result does not depend
// on the other rows of the call (torch's float32 matmul through MKL does on
// Zen 3: a row's bits change with M), so the rows out of a step
// (output_rows) and a batch of one give the bits of the whole batch.
#include <torch/extension.h>

#include "formats.h"
#include "kv_prefetch.h"
#include "no_gil.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <omp.h>

#if defined(__AVX512BF16__)
#define TOKENMILL_GEMM_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_GEMM_BF16 0
#endif

#if defined(TOKENMILL_GEMM_BF16)
#include <immintrin.h>

namespace {

struct GemmArgs {
  const void* x;      // [M, K] bf16 or float32
  const void* w;      // packed
  const float* bias;  // [N padded to 16] float32, or null
  uint16_t* y16;      // [M, N] bf16 out, or null
  float* y32;         // [M, N] float32 out, or null
  int64_t K, N;
};

// step(kk) for kk = 0 .. steps - 1; with KV, this thread's K/V prefetch stream
// kv (kv_prefetch.h) fed one row every 16 steps, outside the inner loop (a check
// inside it cost 12% at 64+ rows). The AVX2 build unrolls the steps by 4: its
// step is ~25 instructions for 12 FMAs, and the loop's own compare, branch
// and increments were a sixth of them. The AVX-512 build keeps its loop
// as it was measured (docs/perf-notes.md).
#if TOKENMILL_GEMM_BF16
#define TOKENMILL_K_UNROLL _Pragma("GCC unroll 1")
#else
#define TOKENMILL_K_UNROLL _Pragma("GCC unroll 4")
#endif
template <bool KV, typename Step>
__attribute__((always_inline)) inline void k_loop(int64_t steps, Step& step, KvPrefetch* kv) {
  if constexpr (KV) {
    for (int64_t k0 = 0; k0 < steps; k0 += 16) {
      kv->next_row();
      const int64_t k1 = std::min<int64_t>(steps, k0 + 16);
      TOKENMILL_K_UNROLL
      for (int64_t kk = k0; kk < k1; ++kk) step(kk);
    }
  } else {
    TOKENMILL_K_UNROLL
    for (int64_t kk = 0; kk < steps; ++kk) step(kk);
  }
}

#if TOKENMILL_GEMM_BF16
// silu(g) * u as fused_ops.cpp's silu_and_mul computes it from bf16 g and u,
// lane by lane, to the bit: the same float operations in the same order (no
// fused multiply-adds, as there: built with -ffp-contract=off), rounded to bf16.
inline __m512 round_bf16(__m512 x) {  // to bf16 (nearest even) and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
inline __m256i silu_mul_bf16(__m512 g, __m512 u) {
  const __m512 x = round_bf16(g);
  __m512 e = _mm512_sub_ps(_mm512_setzero_ps(), x);  // exp_approx(-x)
  e = _mm512_min_ps(_mm512_max_ps(e, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 fn = _mm512_roundscale_ps(_mm512_mul_ps(e, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(e, _mm512_mul_ps(fn, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(fn, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fn), _mm512_set1_epi32(127)), 23);
  e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16(silu), round_bf16(u)));
}

// Rows m0 .. m0+MT of x times the NB blocks starting at w[0..NB). `pp`, if
// not null: a step of the next group's blocks (the first at pp, the others a
// block apart; SILU: two gate blocks at pp, two up blocks pd bytes after),
// one line of each every `every` steps while the step is below `stop`, the
// next step's at the next trigger, fetched into L2 meanwhile (into L1 they
// would push out the weights in use). A step is
// one 64-byte vector of each block: a pair of K (bf16) or one K (float32).
// SILU: the blocks are (gate, up) pairs, and the tile writes silu(gate) * up
// (one block of outputs a pair) instead of the sums: `col` is the first output
// block (in y's columns / 16) of block 0 (of pair 0 with SILU).
// KV: this thread feeds its K/V prefetch stream kv (k_loop; null without KV).
template <bool BF16, int MT, int NB, bool SILU = false, bool KV = false>
inline void tile(const GemmArgs& a, int64_t m0, const char* const* w, int64_t col, KvPrefetch* kv, const char* pp,
                 int64_t pd = 0, int64_t stop = 0, int every = 1) {
  const int64_t steps = BF16 ? a.K / 2 : a.K;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t next_pf = pp ? 0 : steps;  // the next step that prefetches (no division a step)
  auto step = [&](int64_t kk) __attribute__((always_inline)) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w[j] + kk * 64);
    if (kk == next_pf) {
      const int64_t blk = steps * 64;  // (the next group's blocks lie blk bytes apart)
      if constexpr (SILU) {  // gate blocks at pp, up blocks pd bytes after them
        _mm_prefetch(pp, _MM_HINT_T1);
        _mm_prefetch(pp + blk, _MM_HINT_T1);
        _mm_prefetch(pp + pd, _MM_HINT_T1);
        _mm_prefetch(pp + pd + blk, _MM_HINT_T1);
      } else {
        for (int j = 0; j < NB; ++j) _mm_prefetch(pp + blk * j, _MM_HINT_T1);
      }
      pp += 64;
      next_pf += every;
      if (next_pf >= stop) next_pf = steps;
    }
    for (int i = 0; i < MT; ++i) {
      if constexpr (BF16) {  // x[i][2kk], x[i][2kk+1] as one 32-bit pair
        const int32_t* x = static_cast<const int32_t*>(a.x) + (m0 + i) * steps;
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[kk]);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, (__m512bh)wv[j]);
      } else {
        const __m512 xb = _mm512_set1_ps(static_cast<const float*>(a.x)[(m0 + i) * a.K + kk]);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);
      }
    }
  };
  k_loop<KV>(steps, step, kv);
  if constexpr (SILU) {  // (bf16 only; N: the outputs, one per pair lane; no bias)
    for (int j = 0; j < NB; j += 2) {
      const int64_t n0 = (col + j / 2) * 16;
      const __mmask16 mask = a.N - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.N - n0)) - 1);
      for (int i = 0; i < MT; ++i)
        _mm256_mask_storeu_epi16(a.y16 + (m0 + i) * a.N + n0, mask, silu_mul_bf16(acc[i][j], acc[i][j + 1]));
    }
    return;
  }
  // Lanes are outputs 16 (col + j) .. +16; the last block of an N that is not a
  // multiple of 16 stores only its real lanes.
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (col + j) * 16;
    const __mmask16 mask = a.N - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.N - n0)) - 1);
    const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MT; ++i) {
      const __m512 r = _mm512_add_ps(acc[i][j], bias);  // + 0 leaves the sum as it is
      if (a.y32)
        _mm512_mask_storeu_ps(a.y32 + (m0 + i) * a.N + n0, mask, r);
      else
        _mm256_mask_storeu_epi16(a.y16 + (m0 + i) * a.N + n0, mask, (__m256i)_mm512_cvtneps_pbh(r));
    }
  }
}

#else
// The next group's weights (one contiguous stretch: its blocks lie one after
// the other), asked for one cache line every `every` steps of this group's
// tiles, in address order: [p, end) still to go.
struct WeightStream {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t every = 1;
};

// silu(x) lane by lane, to the bit as fused_ops.cpp's silu_and_mul computes
// it (x / (1 + exp_approx(-x)) there): the same operations in the same order,
// no fused multiply-adds (built with -ffp-contract=off), the clamps' NaN
// behaviour included (max(-87, x) is x < -87 ? -87 : x).
inline __m256 silu_f32(__m256 x) {
  __m256 e = _mm256_xor_ps(x, _mm256_set1_ps(-0.f));  // -x
  e = _mm256_max_ps(_mm256_set1_ps(-87.f), e);
  e = _mm256_min_ps(_mm256_set1_ps(88.f), e);
  const __m256 fn = _mm256_round_ps(_mm256_mul_ps(e, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(e, _mm256_mul_ps(fn, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fn, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127)), 23);
  e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

// silu(x) * u in float32, as silu_and_mul computes it there.
inline __m256 silu_mul_f32(__m256 x, __m256 u) { return _mm256_mul_ps(silu_f32(x), u); }

// x rounded to bf16 (nearest even; a NaN to 0x7fc0), as fused_ops.cpp's
// from_f and torch round, kept as float32 (the low 16 bits zero).
inline __m256 round_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

// Two float32 vectors already rounded to bf16 (round_bf16) as 16 bf16 values.
inline __m256i pack_bf16(__m256 lo, __m256 hi) {
  const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(lo), 16), b = _mm256_srli_epi32(_mm256_castps_si256(hi), 16);
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);  // (packus works per 128-bit lane)
}

// 8 bf16 values as float32 (exact).
inline __m256 load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The AVX2 tile: the NB blocks one after the other, each in tiles of MT rows x
// 16 outputs (two 8-lane halves), x[k] broadcast from memory; otherwise as
// the AVX-512 tile above (K/V feed), but the next group's weights come from
// `pf`, a stream that every tile of the group (rows below) carries on from
// where the last one left it. SILU: the blocks are (gate, up) pairs; a gate
// block's sums wait in y for its up block's, and the tile writes silu(gate) *
// up there; the up blocks' stream is pf2.
// BF16: x is the tile's float32 panel (run<>: [K/2][MT][2], exact), and each
// step takes a pair of K: the 32-bit lanes of the packed weights hold (k even, k odd) as bf16,
// so the odd k's weights are the lanes with their low half cleared and the
// even k's the lanes shifted left by 16, both exact in float32. The odd k is
// added first, as vdpbf16ps does (Intel's pseudo-code), one FMA a product
// (exact: two bf16 make a float32 product). The two halves of a step take
// their weights in turn, so that 12 accumulators, 2 weight vectors and a
// broadcast fit the 16 registers. (Widening a group's weights once into a
// float32 scratch for all its tiles was slower: docs/perf-notes.md.)
// The steps are written out in full on purpose: shared lambdas for the
// prefetch feed or the FMA rows moved accumulators onto the stack (objdump:
// vfmadd213ps from (%rsp) in the K loop); the bf16 SILU tile runs at most 5
// rows (max_tile_rows) for the same reason.
template <bool BF16, int MT, int NB, bool SILU = false, bool KV = false>
inline void tile(const GemmArgs& a, int64_t m0, const char* const* w, int64_t col, KvPrefetch* kv, WeightStream& pf,
                 WeightStream& pf2) {
  const int64_t steps = BF16 ? a.K / 2 : a.K;
  const float* x = static_cast<const float*>(a.x) + m0 * a.K;  // (BF16: the tile's panel, [K/2][MT][2])
  const float* xr[MT];  // a pointer a row: the broadcasts address [xr[i] + 4 kk], no lea each
  for (int i = 0; i < MT; ++i) xr[i] = x + i * a.K;
  for (int j = 0; j < NB; ++j) {
    const float* wj = reinterpret_cast<const float*>(w[j]);
    __m256 acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    WeightStream& ws = SILU && j % 2 ? pf2 : pf;
    const char* pp = ws.p;  // (in registers through the K loop)
    const char* const pend = ws.end;
    const int64_t every = ws.every;
    int64_t next_pf = pp < pend ? 0 : steps;  // the next step that prefetches (no division a step)
    auto step = [&](int64_t kk) __attribute__((always_inline)) {
      if constexpr (BF16) {
        const __m256i* wp = reinterpret_cast<const __m256i*>(wj + kk * 16);
        const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        __m256 w0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wp), odd));
        __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wp + 1), odd));
        if (kk == next_pf) {
          prefetch_line<_MM_HINT_T1>(pp);
          pp += 64;
          next_pf = pp < pend ? next_pf + every : steps;
        }
        for (int i = 0; i < MT; ++i) {
          const __m256 xb = _mm256_broadcast_ss(x + kk * 2 * MT + 2 * i + 1);
          acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
        }
        asm("" : "+r"(wp));  // load the lanes again (L1) rather than keep 4 weight registers
        w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wp), 16));
        w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wp + 1), 16));
        for (int i = 0; i < MT; ++i) {
          const __m256 xb = _mm256_broadcast_ss(x + kk * 2 * MT + 2 * i);
          acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
        }
      } else {
        const __m256 w0 = _mm256_loadu_ps(wj + kk * 16), w1 = _mm256_loadu_ps(wj + kk * 16 + 8);
        if (kk == next_pf) {
          prefetch_line<_MM_HINT_T1>(pp);
          pp += 64;
          next_pf = pp < pend ? next_pf + every : steps;
        }
        for (int i = 0; i < MT; ++i) {
          const __m256 xb = _mm256_broadcast_ss(xr[i] + kk);
          acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
        }
      }
    };
    k_loop<KV>(steps, step, kv);
    ws.p = pp;
    if constexpr (SILU && BF16) {  // as below, in bf16: the gate's sums wait rounded (as silu_and_mul reads them)
      uint16_t* y = a.y16 + m0 * a.N + (col + j / 2) * 16;
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        __m256i* yi = reinterpret_cast<__m256i*>(y + i * a.N);
        if (j % 2 == 0) {
          _mm256_storeu_si256(yi, pack_bf16(round_bf16(acc[i][0]), round_bf16(acc[i][1])));
        } else {
          const __m256 g0 = load_bf16(y + i * a.N), g1 = load_bf16(y + i * a.N + 8);
          const __m256 o0 = _mm256_mul_ps(round_bf16(silu_f32(g0)), round_bf16(acc[i][0]));
          const __m256 o1 = _mm256_mul_ps(round_bf16(silu_f32(g1)), round_bf16(acc[i][1]));
          _mm256_storeu_si256(yi, pack_bf16(round_bf16(o0), round_bf16(o1)));
        }
      }
    } else if constexpr (SILU) {  // (no bias; N: the outputs, a multiple of 16; no early exit, as below)
      // The gate block's sums wait in the outputs' place (in L1) for the up block's.
      float* y = a.y32 + m0 * a.N + (col + j / 2) * 16;
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        if (j % 2 == 0) {
          _mm256_storeu_ps(y + i * a.N, acc[i][0]);
          _mm256_storeu_ps(y + i * a.N + 8, acc[i][1]);
        } else {
          _mm256_storeu_ps(y + i * a.N, silu_mul_f32(_mm256_loadu_ps(y + i * a.N), acc[i][0]));
          _mm256_storeu_ps(y + i * a.N + 8, silu_mul_f32(_mm256_loadu_ps(y + i * a.N + 8), acc[i][1]));
        }
      }
    } else {
    // Plain stores where the block's 16 outputs are all real: a masked store
    // (vmaskmovps) is microcoded on AMD's AVX2 cores. Written out per case, with
    // no early exit, so that the accumulators stay in registers through the K loop.
    const int64_t n0 = (col + j) * 16, lanes = std::min<int64_t>(16, a.N - n0);
    // (the bias is padded to whole blocks; + 0 leaves the sum as it is)
    const __m256 b0 = a.bias ? _mm256_loadu_ps(a.bias + n0) : _mm256_setzero_ps();
    const __m256 b1 = a.bias ? _mm256_loadu_ps(a.bias + n0 + 8) : _mm256_setzero_ps();
    if (BF16 && !a.y32) {  // bf16 out: each sum rounded once
      uint16_t* y = a.y16 + m0 * a.N + n0;
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        const __m256i r = pack_bf16(round_bf16(_mm256_add_ps(acc[i][0], b0)), round_bf16(_mm256_add_ps(acc[i][1], b1)));
        if (lanes == 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * a.N), r);
        } else {  // the last block of an N that is not a multiple of 16: its real lanes only
          alignas(32) uint16_t part[16];
          _mm256_store_si256(reinterpret_cast<__m256i*>(part), r);
          std::copy(part, part + lanes, y + i * a.N);
        }
      }
      continue;
    }
    float* y = a.y32 + m0 * a.N + n0;
    if (lanes == 16) {
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        _mm256_storeu_ps(y + i * a.N, _mm256_add_ps(acc[i][0], b0));
        _mm256_storeu_ps(y + i * a.N + 8, _mm256_add_ps(acc[i][1], b1));
      }
    } else {  // the last block of an N that is not a multiple of 16: its real lanes only
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i mask0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lanes)), lane);
      const __m256i mask1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lanes) - 8), lane);
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        _mm256_maskstore_ps(y + i * a.N, mask0, _mm256_add_ps(acc[i][0], b0));
        _mm256_maskstore_ps(y + i * a.N + 8, mask1, _mm256_add_ps(acc[i][1], b1));
      }
    }
    }
  }
}
#endif

// How both builds tile n rows: as few tiles as tiles of `most` rows would
// take, their sizes as even as can be, the larger ones first (32 rows: 6, 6,
// 5, 5, 5, 5 rather than 6 x 5 + 2: a small tile reads a weight line from L2
// for every few FMAs). A tile's rows are [start(t), start(t) + size(t)).
struct TilePlan {
  int64_t tiles, rows, larger;  // `larger` tiles of rows + 1, then rows each
  TilePlan(int64_t n, int64_t most)
      : tiles((n + most - 1) / most), rows(tiles ? n / tiles : 0), larger(tiles ? n % tiles : 0) {}
  int64_t size(int64_t t) const { return rows + (t < larger); }
  int64_t start(int64_t t) const { return t * rows + std::min(t, larger); }
  int64_t tile_of(int64_t r) const {
    return r < larger * (rows + 1) ? r / (rows + 1) : larger + (r - larger * (rows + 1)) / rows;
  }
};

// The most rows a tile: 6. AVX-512: 18 accumulators, 24 in the SiLU tile, of
// 32 registers (objdump: none on the stack in the K loop). AVX2: 6 rows are 12
// accumulators of 16 registers, but 5 rows in the bf16 SiLU matmul, whose
// 6-row tile kept accumulators on the stack through its K loop (GCC).
template <bool BF16, bool SILU>
constexpr int64_t max_tile_rows() { return TOKENMILL_GEMM_BF16 ? 6 : BF16 && SILU ? 5 : 6; }

constexpr int64_t kGroupBlocks = 3;  // output blocks a task's group (run below; with SILU 2 pairs)

// Rows [m0, m1) times the NB blocks at w, in tiles as TilePlan lays them out.
// The next group's weights (pf: a pointer a block, or null) are prefetched
// meanwhile; with KV, the K/V rows of this thread's stream kv too.
// The switch over tile sizes is written out in each build on purpose: one
// shared helper calling a generic lambda per size changed GCC's inlining of
// the tiles and slowed the AVX2 bf16 SiLU matmul (docs/perf-notes.md).
template <bool BF16, int NB, bool SILU = false, bool KV = false>
void rows(const GemmArgs& a, int64_t m0, int64_t m1, const char* const* w, int64_t col, const char* const* pf,
          KvPrefetch* kv) {
  constexpr int MT = 6;
#if !TOKENMILL_GEMM_BF16
  // AVX2: in address order, one line every `every` steps spread over all the
  // tiles (faster than a strided stream: docs/perf-notes.md).
  // The next group's kGroupBlocks * steps lines over this group's tiles * NB * steps.
  // SILU: the next group's gate blocks and its up blocks, two stretches, two
  // streams (s for the tiles' gate blocks, s2 for their up blocks).
  WeightStream s, s2;
  const TilePlan plan(m1 - m0, max_tile_rows<BF16, SILU>());
  const int64_t tiles = plan.tiles, steps = BF16 ? a.K / 2 : a.K;  // (a step: a line a block)
  if (pf && !SILU) s = {pf[0], pf[0] + kGroupBlocks * steps * 64, std::max<int64_t>(1, tiles * NB / kGroupBlocks)};
  if (pf && SILU) {  // each: 2 blocks' lines over the tiles' NB / 2 blocks of steps
    s = {pf[0], pf[0] + 2 * steps * 64, std::max<int64_t>(1, tiles * (NB / 2) / 2)};
    s2 = {pf[1], pf[1] + 2 * steps * 64, s.every};
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = m0 + plan.start(t);
    switch (plan.size(t)) {
      case 1: tile<BF16, 1, NB, SILU, KV>(a, r0, w, col, kv, s, s2); break;
      case 2: tile<BF16, 2, NB, SILU, KV>(a, r0, w, col, kv, s, s2); break;
      case 3: tile<BF16, 3, NB, SILU, KV>(a, r0, w, col, kv, s, s2); break;
      case 4: tile<BF16, 4, NB, SILU, KV>(a, r0, w, col, kv, s, s2); break;
      case 5: tile<BF16, 5, NB, SILU, KV>(a, r0, w, col, kv, s, s2); break;
      default: tile<BF16, MT, NB, SILU, KV>(a, r0, w, col, kv, s, s2); break;
    }
  }
#else
  // AVX-512: the next group's weights spread over all the tiles where there
  // are three or more (else all in the first), in the order the tiles will
  // read them: tile t the next group's steps [t * ps, (t + 1) * ps), a line
  // of each of its blocks every `every` steps. A core's prefetches deliver
  // only so much, so the fewer tiles share them, the more they hold the tiles
  // up. The state is one pointer (an address-order stream kept as the AVX2
  // build's WeightStream had GCC spill accumulators). docs/perf-notes.md has the
  // variants measured.
  const TilePlan plan(m1 - m0, max_tile_rows<BF16, SILU>());
  const int64_t ntiles = plan.tiles;
  const int every = ntiles >= 3 ? static_cast<int>(ntiles) : 1;
  const int64_t steps = BF16 ? a.K / 2 : a.K;
  // Tile t takes the next group's steps [t * ps, (t + 1) * ps), a line of each
  // of its blocks (pf[j] = pf[0] + j blocks; SILU: the up blocks pd bytes
  // after the gate blocks) every `every` steps.
  const int64_t ps = (steps + every - 1) / every;
  const int64_t pd = SILU && pf ? pf[1] - pf[0] : 0;
  for (int t = 0; t < ntiles; ++t) {
    const int64_t r0 = m0 + plan.start(t);
    const int64_t lines = pf && t < every ? std::max<int64_t>(0, std::min(ps, steps - t * ps)) : 0;
    const char* p = lines ? pf[0] + t * ps * 64 : nullptr;
    const int64_t stop = lines * every;
    switch (plan.size(t)) {
      case 1: tile<BF16, 1, NB, SILU, KV>(a, r0, w, col, kv, p, pd, stop, every); break;
      case 2: tile<BF16, 2, NB, SILU, KV>(a, r0, w, col, kv, p, pd, stop, every); break;
      case 3: tile<BF16, 3, NB, SILU, KV>(a, r0, w, col, kv, p, pd, stop, every); break;
      case 4: tile<BF16, 4, NB, SILU, KV>(a, r0, w, col, kv, p, pd, stop, every); break;
      case 5: tile<BF16, 5, NB, SILU, KV>(a, r0, w, col, kv, p, pd, stop, every); break;
      default: tile<BF16, MT, NB, SILU, KV>(a, r0, w, col, kv, p, pd, stop, every); break;
    }
  }
#endif
}

// rows<>, feeding this thread's K/V prefetch stream kv where it has one (not null).
template <bool BF16, int NB, bool SILU = false>
void rows_kv(const GemmArgs& a, int64_t m0, int64_t m1, const char* const* w, int64_t col, const char* const* pf,
             KvPrefetch* kv) {
  if (kv) rows<BF16, NB, SILU, true>(a, m0, m1, w, col, pf, kv);
  else rows<BF16, NB, SILU, false>(a, m0, m1, w, col, pf, nullptr);
}

// Tasks: groups of GB output blocks (3 blocks; with SILU 2 (gate, up) pairs,
// gate block b paired with up block b + nblocks / 2) times stretches of rows.
// Rows are split only when there are too few groups to keep every thread busy
// (few outputs, many rows). Each task feeds its thread's stream of kv where it
// has rows to go (kv_prefetch.h KvStreams).
// side, y: GemmSide's work in the tiles' region (null: none).
template <bool BF16, bool SILU = false>
void run(const GemmArgs& a_in, int64_t M, int64_t nblocks, const KvStreams& kv, const GemmSide* side = nullptr,
         const at::Tensor* y = nullptr) {
  GemmArgs a = a_in;
  constexpr int64_t GB = SILU ? 2 : kGroupBlocks;  // output blocks a group
  const int64_t blk = (BF16 ? a.K / 2 : a.K) * 64;
  const int64_t outs = SILU ? nblocks / 2 : nblocks, half = SILU ? nblocks / 2 : 0;
  const int64_t groups = (outs + GB - 1) / GB;
  const int64_t threads = omp_get_max_threads();
  int64_t row_chunk = M;
  if (groups < 4 * threads) {
    const int64_t per_group = (4 * threads + groups - 1) / groups;  // row stretches per group
    row_chunk = std::max<int64_t>(48, ((M + per_group - 1) / per_group + 5) / 6 * 6);
  }
  const int64_t chunks = (M + row_chunk - 1) / row_chunk;
#if !TOKENMILL_GEMM_BF16
  // The AVX2 tile broadcasts float32: bf16 x as float32 panels (exact), one a
  // tile (rows<>'s TilePlan of each stretch of rows), [K / 2][rows][2] (each
  // row's pair of K side by side, as in x), so that a tile's broadcasts all
  // come from one pointer (12 pointers' worth of GPRs otherwise: the step ran
  // ~60 instructions for 24 FMAs). A tile's panel starts where its first row's
  // x does (start * K).
  at::Tensor panel;
  if constexpr (BF16) {
    const int64_t pairs = a.K / 2;
    panel = at::empty({M * a.K}, at::kFloat);
    const uint32_t* x = static_cast<const uint32_t*>(a.x);
    uint32_t* out = reinterpret_cast<uint32_t*>(panel.data_ptr<float>());
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      const int64_t c0 = m / row_chunk * row_chunk;
      const TilePlan plan(std::min(M, c0 + row_chunk) - c0, max_tile_rows<BF16, SILU>());
      const int64_t t = plan.tile_of(m - c0), start = plan.start(t), rows = plan.size(t);
      uint32_t* o = out + (c0 + start) * a.K + (m - c0 - start) * 2;
      for (int64_t kk = 0; kk < pairs; ++kk) {
        const uint32_t pair = x[m * pairs + kk];  // (k even in the low half)
        o[kk * rows * 2] = pair << 16;
        o[kk * rows * 2 + 1] = pair & 0xffff0000u;
      }
    }
    a.x = panel.data_ptr<float>();
  }
#endif
  const char* base = static_cast<const char*>(a.w);
  // The weight blocks a group's tiles read, in tile order (with SILU: g, u, g, u).
  auto blocks = [&](int64_t g, const char** w) {
    const int64_t b0 = g * GB, nb = std::min(GB, outs - b0);
    for (int64_t j = 0; j < nb; ++j) {
      if (SILU) {
        w[2 * j] = base + (b0 + j) * blk;
        w[2 * j + 1] = base + (b0 + j + half) * blk;
      } else {
        w[j] = base + (b0 + j) * blk;
      }
    }
    return nb;
  };
#pragma omp parallel
  {
    if (side) side->before();
#pragma omp for schedule(static)
    for (int64_t task = 0; task < groups * chunks; ++task) {
      const int64_t g = task / chunks, c = task % chunks;
      const char* w[2 * GB];
      const char* next[2 * GB];
      const int64_t nb = blocks(g, w), col = g * GB;
      // The first tile over this group's weights prefetches the next group's (a whole one).
      const char* const* pf = c == 0 && g + 1 < groups && blocks(g + 1, next) == GB ? next : nullptr;
      const int64_t m0 = c * row_chunk, m1 = std::min(M, m0 + row_chunk);
      KvPrefetch* const stream = kv.streams ? kv.of_thread(omp_get_thread_num()) : nullptr;
      if constexpr (SILU) {
        if (nb == 2) rows_kv<BF16, 4, true>(a, m0, m1, w, col, pf, stream);
        else rows_kv<BF16, 2, true>(a, m0, m1, w, col, pf, stream);
      } else {
        if (nb == 3) rows_kv<BF16, 3>(a, m0, m1, w, col, pf, stream);
        else if (nb == 2) rows_kv<BF16, 2>(a, m0, m1, w, col, pf, stream);
        else rows_kv<BF16, 1>(a, m0, m1, w, col, pf, stream);
      }
    }
    if (side) side->after(*y);  // (after the loop's barrier)
  }
}

// Each group of blocks reads all of its rows of x: past a few hundred rows x
// no longer stays in cache between groups, so the rows go in stretches of 512.
// f(part, first row, rows).
template <typename F>
void in_stretches(const GemmArgs& a, int64_t M, const at::Tensor& x, const at::Tensor& y, F f) {
  constexpr int64_t stretch = 512;
  const int64_t x_row = x.size(1) * x.element_size(), y_row = y.size(1) * y.element_size();
  for (int64_t m0 = 0; m0 < M; m0 += stretch) {
    GemmArgs part = a;
    part.x = static_cast<const char*>(a.x) + m0 * x_row;
    if (part.y16) part.y16 = reinterpret_cast<uint16_t*>(reinterpret_cast<char*>(a.y16) + m0 * y_row);
    if (part.y32) part.y32 = reinterpret_cast<float*>(reinterpret_cast<char*>(a.y32) + m0 * y_row);
    f(part, m0, std::min(stretch, M - m0));
  }
}

// The dense formats' checks: x in the weight's dtype, the packed data shaped as the format's layout.
void check_dense(const at::Tensor& x, const PackedWeight& w, const char* op) {
  const bool bf16 = w.format == WeightFormat::kBF16;
  TORCH_CHECK(bf16 || w.format == WeightFormat::kFloat32, op, ": not a dense (bfloat16 / float32) weight");
  const at::Tensor& packed = w.data;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, " runs on the CPU");
  TORCH_CHECK(x.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat) && packed.scalar_type() == x.scalar_type(),
              op, ": x and the weights in the weight's dtype (", bf16 ? "bfloat16" : "float32", ")");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == (bf16 ? 4 : 3) && packed.size(2) == 16 && (!bf16 || packed.size(3) == 2),
              op, ": x [M, K], packed [ceil(N/16), K/2, 16, 2] (bf16) or [ceil(N/16), K, 16] (float32)");
  const int64_t K = x.size(1), nblocks = packed.size(0);
  const int64_t packed_k = packed.size(1) * (bf16 ? 2 : 1);
  TORCH_CHECK(packed_k == K && w.k == K, op, ": x has K = ", K, ", the weights ", packed_k);
  TORCH_CHECK(w.n > 16 * (nblocks - 1) && w.n <= 16 * nblocks, op, ": n does not fit the blocks");
}

}  // namespace

std::vector<std::string> packed_gemm_dtypes() { return {"bfloat16", "float32"}; }

at::Tensor dense_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams& kv,
                      const GemmSide* side) {
  NoGil no_gil;
  check_dense(x, w, "packed_gemm");
  const bool bf16 = w.format == WeightFormat::kBF16;
  const int64_t M = x.size(0), K = x.size(1), nblocks = w.data.size(0), n_out = w.n;
  x = x.contiguous();
  const at::Tensor packed = w.data.contiguous();
  at::Tensor bias32;
  if (w.bias.defined() && w.bias.numel() > 0) {
    TORCH_CHECK(w.bias.numel() == n_out, "packed_gemm: one bias per output");
    // In the model's dtype first (bf16 is rounded), added in float32, padded to whole blocks.
    bias32 = at::zeros({nblocks * 16}, x.options().dtype(at::kFloat));
    bias32.narrow(0, 0, n_out).copy_(w.bias.to(x.scalar_type()).to(at::kFloat));
  }
  const bool out32 = float32_out || !bf16;
  at::Tensor y = at::empty({M, n_out}, x.options().dtype(out32 ? at::kFloat : at::kBFloat16));
  if (M == 0) {
    if (side) side->alone(y);
    return y;
  }
  GemmArgs a{x.data_ptr(), packed.data_ptr(), bias32.defined() ? bias32.data_ptr<float>() : nullptr,
             out32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
             out32 ? y.data_ptr<float>() : nullptr, K, n_out};
  // The side work in the last stretch's region, where every row of y is written by its end.
  in_stretches(a, M, x, y, [&](const GemmArgs& part, int64_t m0, int64_t rows) {
    const GemmSide* s = m0 + rows == M ? side : nullptr;
    if (bf16) run<true>(part, rows, nblocks, kv, s, &y);
    else run<false>(part, rows, nblocks, kv, s, &y);
  });
  return y;
}

at::Tensor silu_and_mul(at::Tensor gate_up);  // (fused_ops.cpp)

// silu(gate) * up straight from the gate_up projection (LlamaMLP's act_fn(gate)
// * up): the same bits as silu_and_mul(packed_gemm(x, packed, 2 * inter)), with
// no [M, 2 * inter] intermediate written and read back. The packed gate_up
// weights as they are, gate blocks first, each gate block b paired with up
// block b + nblocks / 2 in the tiles (so inter a multiple of 16). bf16 with
// AVX512-BF16; float32 with AVX2 (the AVX-512 build runs float32 in those two
// steps: its tile's activation rounds to bf16).
at::Tensor dense_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams& kv) {
  NoGil no_gil;
  check_dense(x, w, "packed_gemm_silu");
  const bool bf16 = w.format == WeightFormat::kBF16;
  const int64_t M = x.size(0), K = x.size(1), nblocks = w.data.size(0), inter = w.n / 2;
  TORCH_CHECK(w.n % 32 == 0 && !(w.bias.defined() && w.bias.numel() > 0),
              "packed_gemm_silu: gate_up needs N = 2 inter, inter a multiple of 16, and no bias");
  if (!bf16 && TOKENMILL_GEMM_BF16) return silu_and_mul(dense_gemm(x, w, false, kv, nullptr));
  x = x.contiguous();
  const at::Tensor packed = w.data.contiguous();
  at::Tensor y = at::empty({M, inter}, x.options());
  if (M == 0) return y;
  GemmArgs a{x.data_ptr(), packed.data_ptr(), nullptr,
             bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr,
             bf16 ? nullptr : y.data_ptr<float>(), K, inter};
  // (bf16 in both builds, float32 in the AVX2 one)
#if !TOKENMILL_GEMM_BF16
  if (!bf16) in_stretches(a, M, x, y, [&](const GemmArgs& part, int64_t, int64_t rows) { run<false, true>(part, rows, nblocks, kv); });
  else
#endif
  in_stretches(a, M, x, y, [&](const GemmArgs& part, int64_t, int64_t rows) { run<true, true>(part, rows, nblocks, kv); });
  return y;
}
#else
std::vector<std::string> packed_gemm_dtypes() { return {}; }
at::Tensor dense_gemm(at::Tensor x, const PackedWeight&, bool, const KvStreams&, const GemmSide*) {
  TORCH_CHECK(false, "packed_gemm needs AVX512-BF16 or AVX2 with FMA (built without them)");
  return x;
}
at::Tensor dense_gemm_silu(at::Tensor x, const PackedWeight&, const KvStreams&) {
  TORCH_CHECK(false, "packed_gemm_silu needs AVX512-BF16 or AVX2 with FMA (built without them)");
  return x;
}
#endif
