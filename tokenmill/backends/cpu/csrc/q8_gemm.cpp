// y = x W^T (+ bias) on Q8_0 weights kept quantized (quantization="q8_0";
// model/quantization.py): GGUF's blocks of 32 int8 q and a float16 scale d,
// standing for q * d.
//
// Packed layout (formats.pack_q8_0; zero rows pad N to a multiple of 16): a
// group is 16 outputs, a task 3 groups (the last task of an N that is not a
// multiple of 48: 1 or 2, nb), and a task's groups are interleaved into one
// stretch read front to back: for each pair of blocks (kb = 2 s, 2 s + 1; 64
// inputs) of the task,
//   nb * 64 bytes   the float16 d: block l = 0, 1 of the pair, group j, lane i
//                   at (l * nb + j) * 32 + 2 i (output 48 t + 16 j + i)
//   nb * 1024 bytes for l = 0, 1, each 4 inputs kk = 0..7 and group j, 64 bytes:
//                   lane i's 4 values q + 128 (unsigned), q[48 t + 16 j + i]
//                   [32 kb + 4 kk + 0..3] at ((l * 8 + kk) * nb + j) * 64 + 4 i
// (an odd last block: the pair's second block's values left out, its scales
// padded). A group is 64 ceil(K/64) + 16 K bytes (1.0625 bytes a weight for
// K a multiple of 64), packed uint8 [ceil(N/16), that]; tasks start at 3 t
// groups. Every line holds one vpdpbusd operand or scales, never a split
// load, and each thread reads its tasks (consecutive) as one address-ordered
// stream (docs/perf-notes.md: 544-byte blocks in 3 streams a task read at ~29 GB/s).
//
// Two ways, by the activations' dtype:
// - bfloat16 x (the served dtype): as llama.cpp's Q8_0 x Q8_0 dot, x is
//   quantized per row and block of 32 to int8 (s = max|x| / 127, xq = round(x / s),
//   s kept in float32), and vpdpbusd (AVX512-VNNI) sums 4 products (q + 128) * xq
//   a lane a step in int32, exactly; the +128 is taken back out by starting each
//   block's sum at -128 * sum(xq). A block adds (d s) * its sum to float32
//   accumulators. What this computes differs from the dequantized reference by
//   x's rounding to int8: at most s / 2 an input, i.e. |y - ref| <=
//   sum_k |q d| s_k / 2 (tests/test_quantization.py holds it to that bound).
//   Reading the weights bounds it at decode (8 instructions a 512 weights and row).
// - float32 x (and bf16 x without VNNI): each q widened to float32 and multiplied
//   by its d, which is exact (8 and 11 significant bits in 24): the weights are
//   the dequantized reference's to the bit, and one float32 FMA a k and row,
//   k in order; only the order of the sums differs from the reference.
// Either way a row's result is the same sequence of operations whatever the
// other rows of the call (tiles of up to 4 or 6 rows x 3 groups): the batch
// does not change a row's bits (as packed_gemm).
//
//   x [M, K] bf16 or float32, packed as above, n_out = N, bias [N] or empty
//   -> y [M, N] in x's dtype, or float32 with float32_out (the logits)
#include <torch/extension.h>

#include "block_gemm.h"
#include "no_gil.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TOKENMILL_Q8_AVX512 1
#else
#define TOKENMILL_Q8_AVX512 0
#endif
#if TOKENMILL_Q8_AVX512 && defined(__AVX512VNNI__)
#define TOKENMILL_Q8_VNNI 1
#else
#define TOKENMILL_Q8_VNNI 0
#endif

namespace q8 {

using block_gemm::kTaskGroups;
constexpr int64_t kQ8Block = block_gemm::kBlock;
constexpr int64_t kPairBytes = 64 + 1024;  // a group's share of a pair of blocks: scales, values
// Each thread fetches its stretch into L2 this far ahead of its loads: one
// address-ordered stream across its tasks, started with a burst at its first
// task (docs/perf-notes.md: 6-32 KB, a T0 prefetch in the tile, or the next
// call's first lines fetched too measured the same within noise).
constexpr int64_t kL2Ahead = 16384;

// Bytes of one group (all of K): a task of nb groups is nb times this.
inline int64_t q8_group_bytes(int64_t kb_count) { return 64 * ((kb_count + 1) / 2) + 512 * kb_count; }
// Within a task of nb groups: block kb's 16 scales of group j, and its 64-byte
// values for inputs 32 kb + 4 kk .. + 4 of group j.
inline const uint8_t* q8_scales(const uint8_t* task, int nb, int64_t kb, int j) {
  return task + (kb / 2) * nb * kPairBytes + ((kb % 2) * nb + j) * 32;
}
inline const uint8_t* q8_values(const uint8_t* task, int nb, int64_t kb, int kk, int j) {
  return task + (kb / 2) * nb * kPairBytes + 64 * nb + ((kb % 2) * 8 + kk) * nb * 64 + j * 64;
}

using Q8Args = block_gemm::BlockArgs<int32_t>;  // xt: -128 * the block's sum of xq

// A thread's L2 prefetch stream: [p, end) the rest of its stretch not yet
// asked for; ahead(cur) asks for it up to kL2Ahead bytes past cur.
struct Q8Stream {
  const char* p = nullptr;
  const char* end = nullptr;
  void ahead(const char* cur) {
    for (const char* goal = std::min(end, cur + kL2Ahead); p < goal; p += 64) __builtin_prefetch(p, 0, 2);  // (T1)
  }
};


// The weight of group j's lane i, input 32 kb + k, in a task of nb groups (scalar code).
inline float q8_weight(const uint8_t* task, int nb, int64_t kb, int j, int i, int k) {
  at::Half h;
  std::memcpy(&h, q8_scales(task, nb, kb, j) + 2 * i, 2);
  const int q = static_cast<int>(q8_values(task, nb, kb, k / 4, j)[4 * i + k % 4]) - 128;
  return static_cast<float>(q) * static_cast<float>(h);
}

#if TOKENMILL_Q8_AVX512
// The float path: rows m0 .. m0+MT of float32 x times the task at `task` (groups g0 .. g0+NB).
template <int MT, int NB>
void q8_tile_float(const Q8Args& a, int64_t m0, int64_t g0, const uint8_t* task) {
  const int64_t kb_count = a.K / kQ8Block;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.x + (m0 + i) * a.K;
  const __m512i flip = _mm512_set1_epi32(int32_t(0x80808080u));  // q + 128 -> q as signed bytes
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    __m512 d[NB];
    for (int j = 0; j < NB; ++j)
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8_scales(task, NB, kb, j))));
    const int64_t k0 = kb * kQ8Block;
    for (int kk = 0; kk < 8; ++kk) {
      __m512i v[NB];
      for (int j = 0; j < NB; ++j)
        v[j] = _mm512_xor_si512(_mm512_loadu_si512(reinterpret_cast<const void*>(q8_values(task, NB, kb, kk, j))),
                                flip);
      for (int t = 0; t < 4; ++t) {
        __m512 w[NB];
        for (int j = 0; j < NB; ++j) {  // byte t of each lane, sign-extended: q exactly; * d exact
          const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v[j], 24 - 8 * t), 24);
          w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d[j]);
        }
        for (int i = 0; i < MT; ++i) {
          const __m512 xb = _mm512_set1_ps(xr[i][k0 + 4 * kk + t]);
          for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
        }
      }
    }
  }
  block_gemm::store<int32_t, MT, NB>(a, m0, g0, acc);
}

#if TOKENMILL_Q8_VNNI
// The VNNI path: rows m0 .. m0+MT of quantized x times the task at `task`
// (groups g0 .. g0+NB), its lines read in address order. s, if not null:
// this thread's L2 stream, fed NB lines a step and caught up at each block's
// end (only the first row tile of a task feeds it; the others read from L2).
// Prefetches change no bits.
template <int MT, int NB>
void q8_tile_vnni(const Q8Args& a, int64_t m0, int64_t g0, const uint8_t* task, Q8Stream* s) {
  const int64_t kb_count = a.K / kQ8Block;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const char* pp = s ? s->p : nullptr;  // (in a register through the loop)
  const char* const pend = s ? s->end : nullptr;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    __m512i sum[MT][NB];
    for (int i = 0; i < MT; ++i) {
      const __m512i start = _mm512_set1_epi32(a.xt[(m0 + i) * kb_count + kb]);
      for (int j = 0; j < NB; ++j) sum[i][j] = start;
    }
    const uint8_t* v = q8_values(task, NB, kb, 0, 0);
    for (int kk = 0; kk < 8; ++kk) {
      __m512i w[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = v + (kk * NB + j) * 64;
        w[j] = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
      }
      for (int i = 0; i < MT; ++i) {
        int32_t four;
        std::memcpy(&four, a.xq + (m0 + i) * a.K + kb * kQ8Block + 4 * kk, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int j = 0; j < NB; ++j) sum[i][j] = _mm512_dpbusd_epi32(sum[i][j], w[j], xb);
      }
      for (int j = 0; j < NB; ++j) {
        if (pp < pend) {
          _mm_prefetch(pp, _MM_HINT_T1);
          pp += 64;
        }
      }
    }
    if (s) {
      s->p = pp;
      s->ahead(reinterpret_cast<const char*>(v + 8 * NB * 64));
      pp = s->p;
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8_scales(task, NB, kb, j))));
      for (int i = 0; i < MT; ++i) {
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.xs[(m0 + i) * kb_count + kb]));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][j]), ds, acc[i][j]);
      }
    }
  }
  block_gemm::store<int32_t, MT, NB>(a, m0, g0, acc);
}
#endif

template <bool VNNI, int MT>
void q8_rows(const Q8Args& a, int64_t m0, int64_t g0, int nb, const uint8_t* task, Q8Stream* s) {
#if TOKENMILL_Q8_VNNI
  if constexpr (VNNI) {
    if (nb == 3) q8_tile_vnni<MT, 3>(a, m0, g0, task, s);
    else if (nb == 2) q8_tile_vnni<MT, 2>(a, m0, g0, task, s);
    else q8_tile_vnni<MT, 1>(a, m0, g0, task, s);
    return;
  }
#else
  (void)s;
#endif
  if (nb == 3) q8_tile_float<MT, 3>(a, m0, g0, task);
  else if (nb == 2) q8_tile_float<MT, 2>(a, m0, g0, task);
  else q8_tile_float<MT, 1>(a, m0, g0, task);
}
#endif

// Rows [0, M) times task t (groups g0 .. g0+nb), in row tiles (VNNI: 4 rows,
// its int32 and float32 accumulators both in registers; float: 6). VNNI: the
// first row tile feeds this thread's L2 stream s (the rest read the task from L2).
void q8_task(const Q8Args& a, int64_t M, int64_t g0, int nb, bool vnni, Q8Stream* s) {
  const uint8_t* task = a.w + g0 * q8_group_bytes(a.K / kQ8Block);
#if TOKENMILL_Q8_AVX512
  if (vnni) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      Q8Stream* first = m0 == 0 ? s : nullptr;
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: q8_rows<true, 4>(a, m0, g0, nb, task, first); break;
        case 3: q8_rows<true, 3>(a, m0, g0, nb, task, first); break;
        case 2: q8_rows<true, 2>(a, m0, g0, nb, task, first); break;
        default: q8_rows<true, 1>(a, m0, g0, nb, task, first); break;
      }
    }
    return;
  }
  (void)s;
  for (int64_t m0 = 0; m0 < M; m0 += 6) {
    switch (std::min<int64_t>(6, M - m0)) {
      case 6: q8_rows<false, 6>(a, m0, g0, nb, task, nullptr); break;
      case 5: q8_rows<false, 5>(a, m0, g0, nb, task, nullptr); break;
      case 4: q8_rows<false, 4>(a, m0, g0, nb, task, nullptr); break;
      case 3: q8_rows<false, 3>(a, m0, g0, nb, task, nullptr); break;
      case 2: q8_rows<false, 2>(a, m0, g0, nb, task, nullptr); break;
      default: q8_rows<false, 1>(a, m0, g0, nb, task, nullptr); break;
    }
  }
#else  // the float path's sums, one lane at a time
  (void)vnni;
  (void)s;
  const int64_t kb_count = a.K / kQ8Block;
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < nb; ++j)
      for (int l = 0; l < 16 && (g0 + j) * 16 + l < a.N; ++l) {
        float acc = 0.f;
        for (int64_t kb = 0; kb < kb_count; ++kb)
          for (int k = 0; k < kQ8Block; ++k)
            acc = std::fma(a.x[m * a.K + kb * kQ8Block + k], q8_weight(task, nb, kb, j, l, k), acc);
        block_gemm::store_one(a, m, (g0 + j) * 16 + l, acc);
      }
#endif
}

}  // namespace q8

// Q8_0's row of block_gemm.h's driver.
struct Q8_0Format {
  static constexpr const char* kName = "Q8_0";
  static constexpr bool kVnni = TOKENMILL_Q8_VNNI;
  using Term = int32_t;  // -128 * sum(xq): the start of a block's sum against the weights' q + 128
  static Term term(float, int32_t total) { return -128 * total; }
  static int64_t group_bytes(int64_t K) { return q8::q8_group_bytes(K / q8::kQ8Block); }
  // This thread's tasks [t0, t1), one address-ordered L2 stream across them (int8 path).
  static void tasks(const q8::Q8Args& a, int64_t M, int64_t t0, int64_t t1, int64_t groups, bool vnni) {
    const int64_t bytes = group_bytes(a.K);
    q8::Q8Stream s;
    if (vnni) {
      const char* w = reinterpret_cast<const char*>(a.w);
      s.p = w + t0 * q8::kTaskGroups * bytes;
      s.end = w + std::min(groups, t1 * q8::kTaskGroups) * bytes;
      s.ahead(s.p);
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * q8::kTaskGroups;
      q8::q8_task(a, M, g0, static_cast<int>(std::min<int64_t>(q8::kTaskGroups, groups - g0)), vnni,
                  vnni ? &s : nullptr);
    }
  }
};

at::Tensor q8_0_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams&,
                     const GemmSide* side) {
  return block_gemm::gemm<Q8_0Format>(std::move(x), w, float32_out, side);
}
at::Tensor q8_0_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams&) {
  return block_gemm::gemm_silu<Q8_0Format>(std::move(x), w);
}

// (q int8 [N, K], d float16 [N, K / 32]) -> the packed layout above, into out (uint8
// [ceil(N / 16), q8_group_bytes], formats.pack_q8_0 allocates it), once at load: one pass,
// the tasks shared out over the threads. Padding rows: q 0 (stored 128) and d 0; an odd
// last block's missing partner: d 0.
void q8_pack(at::Tensor q, at::Tensor d, at::Tensor out) {
  NoGil no_gil;
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && d.dim() == 2 && d.scalar_type() == at::kHalf &&
                  out.scalar_type() == at::kByte,
              "q8_pack: q int8 [N, K], d float16 [N, K / 32] and uint8 out");
  q = q.contiguous();
  d = d.contiguous();
  const int64_t n = q.size(0), k = q.size(1), kb_count = k / q8::kQ8Block, groups = (n + 15) / 16;
  const int64_t pairs = (kb_count + 1) / 2, group_bytes = q8::q8_group_bytes(kb_count);
  TORCH_CHECK(k % q8::kQ8Block == 0 && d.size(0) == n && d.size(1) == kb_count,
              "q8_pack: K a multiple of 32 and d [N, K / 32]");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == groups && out.size(1) == group_bytes,
              "q8_pack: out must be uint8 [", groups, ", ", group_bytes, "] contiguous");
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  uint8_t* const op = out.data_ptr<uint8_t>();
  constexpr int64_t kTaskGroups = block_gemm::kTaskGroups;
  const int64_t tasks = (groups + kTaskGroups - 1) / kTaskGroups;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t g0 = t * kTaskGroups, nb = std::min<int64_t>(kTaskGroups, groups - g0);
    uint8_t* dst = op + g0 * group_bytes;
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t blocks = std::min<int64_t>(2, kb_count - 2 * p);
      for (int64_t l = 0; l < 2; ++l)  // the scales: block l, group j, lane i
        for (int64_t j = 0; j < nb; ++j)
          for (int64_t i = 0; i < 16; ++i, dst += 2) {
            const int64_t row = 16 * (g0 + j) + i;
            const uint16_t v = row < n && l < blocks ? dp[row * kb_count + 2 * p + l] : 0;
            std::memcpy(dst, &v, 2);
          }
      for (int64_t l = 0; l < blocks; ++l)  // the values: block l, 4 inputs kk, group j, lane i
        for (int64_t kk = 0; kk < 8; ++kk)
          for (int64_t j = 0; j < nb; ++j)
            for (int64_t i = 0; i < 16; ++i, dst += 4) {
              const int64_t row = 16 * (g0 + j) + i;
              for (int c = 0; c < 4; ++c)
                dst[c] = static_cast<uint8_t>(
                    (row < n ? qp[row * k + q8::kQ8Block * (2 * p + l) + 4 * kk + c] : 0) + 128);
            }
    }
  }
}
