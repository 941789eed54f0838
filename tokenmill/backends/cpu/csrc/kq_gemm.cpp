// y = x W^T (+ bias) on GGUF's Q4_0, Q5_0, Q4_K, Q5_K and Q6_K blocks, repacked at load
// (quantization="gguf"; model/quantization.py reads the file's blocks, formats.pack_kquant
// repacks them; no float copy). Each format stands for integer q (4, 5 or 6 bits,
// unsigned) and per-super-block scales, the value of a weight being
//   Q4_0: d (q - 8)        Q5_0: d (q - 16)          (super-block = sub-block = 32 inputs)
//   Q4_K, Q5_K: (d sc) q - (dmin mn)  (256 inputs; sc, mn 6-bit per 32 inputs)
//   Q6_K: (d sc) (q - 32)              (256 inputs; sc int8 per 16 inputs)
// with d, dmin float16: gguf-py's dequantize computes them in float32 in that order.
//
// Packed layout (formats.pack_kquant; zero rows pad N to a multiple of 16): group g
// (outputs 16 g .. 16 g + 15) is K / SB super-blocks one after the other, each
//   header: 16 float16 d (lane j: output 16 g + j); [K-quants with mins] 16 float16
//           dmin; [scales] for each sub-block s 16 bytes sc (lane order); [mins] for
//           each pair of sub-blocks 2 p, 2 p + 1 32 bytes, byte 2 j + t the mn of
//           sub-block 2 p + t (once widened to int16, vpdpwssd's operand)
//   SB / 32 chunks of 32 inputs, each: for 8 inputs kk = 0..3, 64 bytes, byte 4 j + t
//           holding q[j][8 kk + t] & 15 in its low nibble and q[j][8 kk + 4 + t] & 15
//           in its high one (q4_gemm.cpp's operands); then for each kk and high bit
//           b (P of them: Q5 1, Q6 2) two 64-bit masks, bit 4 j + t of the first the
//           bit 4 + b of q[j][8 kk + t], of the second of q[j][8 kk + 4 + t]
// so a group streams front to back, at the file's bytes a weight but for the
// unpacked 6-bit scales (Q4_K, Q5_K: 20 bytes a super-block and output, the file 16).
// A vpdpbusd operand is the nibbles plus 16 << b where a mask bit is set.
//
// Two ways, by the activations' dtype (as q4_gemm.cpp):
// - bfloat16 x with AVX512-VNNI: x quantized per row and super-block (32 or 256: Q8_K)
//   to int8 (act_quant.h), vpdpbusd sums q * xq per sub-block exactly in int32, and
//   the super-block's integer terms (sc (dot - off sum(xq)), mn sum(xq)) stay integers
//   until one float32 step: acc += (d s) isum - (dmin s) msum. It differs from the
//   dequantized reference by x's rounding only: |y - ref| <= sum_k |w_k| s_k / 2.
//   The sums of xq come with x (KqFormat::terms): -off sum(xq) a sub-block, or (mins)
//   a pair's two sums as int16, so msum is one vpdpwssd a pair; |sum(xq)| <= 32 * 127.
//   Row tiles of up to 4 rows share each group's unpacked operands: at one row the
//   weights' bytes bound the GEMV, at more the port that runs vpdpbusd and vpmulld
//   (docs/perf-notes.md: the k-quants' read rate by row count).
// - float32 x (and bf16 x without VNNI): the weights exactly as gguf-py dequantizes
//   them, one float32 FMA a k and row, k in order.
// Either way a row's result is the same sequence of operations whatever the other
// rows of the call: the batch does not change a row's bits.
#include <torch/extension.h>

#include "block_gemm.h"
#include "kq_formats.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TOKENMILL_KQ_AVX512 1
#else
#define TOKENMILL_KQ_AVX512 0
#endif
#if TOKENMILL_KQ_AVX512 && defined(__AVX512VNNI__)
#define TOKENMILL_KQ_VNNI 1
#else
#define TOKENMILL_KQ_VNNI 0
#endif

namespace kq {

constexpr int kMaxGroups = block_gemm::kTaskGroups;
constexpr int64_t kPrefetchBytes = 2048;  // (q8_gemm's rule)


using Args = block_gemm::BlockArgs<int32_t>;  // xs: a scale a super-block; xt: KqTerms of it

// A super-block's terms of x (block_gemm's xt), from its int8 xq: with mins (OFF 0) the
// sub-blocks' sums of xq two to an int32, as int16 (vpdpwssd's operand against the mins'
// pairs; |sum| <= 32 * 127); else -OFF times each sub-block's sum (added to its dot).
template <class F>
struct KqTerms {
  static_assert(F::MINS == (F::OFF == 0) && (!F::MINS || F::NSUB % 2 == 0), "mins xor an offset");
  static constexpr int64_t kPerBlock = F::MINS ? F::NSUB / 2 : F::NSUB;
  static void of(int32_t total, const int8_t* xq, int32_t* out) {
    int32_t part[F::NSUB];
    if constexpr (F::NSUB == 1) {
      part[0] = total;
    } else {
      for (int64_t t = 0; t < F::NSUB; ++t) {
        part[t] = 0;
        for (int64_t k = 0; k < F::SUB; ++k) part[t] += xq[t * F::SUB + k];
      }
    }
    for (int64_t t = 0; t < kPerBlock; ++t) {
      if constexpr (F::MINS) {
        const uint32_t pair = static_cast<uint16_t>(part[2 * t]) | (static_cast<uint32_t>(part[2 * t + 1]) << 16);
        std::memcpy(out + t, &pair, 4);
      } else {
        out[t] = -F::OFF * part[t];
      }
    }
  }
};

inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The weight of lane j, input k of a super-block, as gguf-py computes it (scalar code).
template <class F>
inline float weight_at(const uint8_t* sb, int j, int64_t k) {
  const uint8_t* chunk = sb + F::HEADER + (k / 32) * F::CHUNK;
  const int kk = static_cast<int>(k % 32) / 8, t8 = static_cast<int>(k % 8), h = t8 / 4, t = t8 % 4;
  const uint8_t byte = chunk[64 * kk + 4 * j + t];
  int q = h ? byte >> 4 : byte & 15;
  for (int b = 0; b < F::P; ++b) {
    uint64_t mask;
    std::memcpy(&mask, chunk + 256 + 16 * F::P * kk + 16 * b + 8 * h, 8);
    if ((mask >> (4 * j + t)) & 1) q += 16 << b;
  }
  const int s = static_cast<int>(k / F::SUB);
  float a = half_at(sb + 2 * j), m = 0.f;
  if constexpr (F::SCALES) {
    const uint8_t raw = sb[F::SC_AT + 16 * s + j];
    a *= static_cast<float>(F::SIGNED ? static_cast<int>(static_cast<int8_t>(raw)) : static_cast<int>(raw));
  }
  if constexpr (F::MINS) m = half_at(sb + 32 + 2 * j) * static_cast<float>(sb[F::MN_AT + 32 * (s / 2) + 2 * j + s % 2]);
  return a * static_cast<float>(q - F::OFF) - m;
}

#if TOKENMILL_KQ_AVX512

// A chunk's 8 inputs kk as two operands (inputs 8 kk + t and 8 kk + 4 + t at byte 4 j + t),
// the nibbles plus their high bits.
template <class F>
inline void operands(const uint8_t* chunk, int kk, __m512i& lo, __m512i& hi) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(chunk + 64 * kk));
  lo = _mm512_and_si512(raw, nib);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
  for (int b = 0; b < F::P; ++b) {
    const uint8_t* m = chunk + 256 + 16 * F::P * kk + 16 * b;
    uint64_t ml, mh;
    std::memcpy(&ml, m, 8);
    std::memcpy(&mh, m + 8, 8);
    const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << b));
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(ml), lo, add);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(mh), hi, add);
  }
}

// 16 lanes' bytes at p widened to int32 (signed for Q6_K's scales).
template <bool SIGNED>
inline __m512i lanes_i32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

// A pair of sub-blocks' mins (header at hdr, pair p) as int16: lane j's dword (mn[2 p], mn[2 p + 1]).
template <class F>
inline __m512i min_pair(const uint8_t* hdr, int64_t p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + F::MN_AT + 32 * p)));
}

// Sub-block s's mins alone, 16 lanes as int32 (the float path).
template <class F>
inline __m512i min_lanes(const uint8_t* hdr, int64_t s) {
  const __m512i pair = min_pair<F>(hdr, s / 2);
  return s % 2 ? _mm512_srli_epi32(pair, 16) : _mm512_and_si512(pair, _mm512_set1_epi32(0xffff));
}

// 4 bytes at p broadcast to every lane (from memory: a load, no shuffle).
inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The float path: rows m0 .. m0+MT of float32 x times groups g0 .. g0+NB.
template <class F, int MT, int NB>
void tile_float(const Args& a, int64_t m0, int64_t g0) {
  const int64_t sbs = a.K / F::SB, group_bytes = sbs * F::BYTES;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.x + (m0 + i) * a.K;
  const __m512i byte = _mm512_set1_epi32(0xff), off = _mm512_set1_epi32(F::OFF);
  for (int64_t sb = 0; sb < sbs; ++sb) {
    const uint8_t* hdr[NB];
    __m512 d[NB], dmin[NB];
    for (int j = 0; j < NB; ++j) {
      hdr[j] = a.w + (g0 + j) * group_bytes + sb * F::BYTES;
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr[j])));
      dmin[j] = F::MINS ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr[j] + 32)))
                        : _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < F::SB / 32; ++c) {
      for (int kk = 0; kk < 4; ++kk) {
        const int64_t s = (32 * c + 8 * kk) / F::SUB;
        __m512 scale[NB], sub[NB];  // w = scale (q - OFF) - sub, as gguf-py
        __m512i v[NB][2];
        for (int j = 0; j < NB; ++j) {
          scale[j] = F::SCALES ? _mm512_mul_ps(d[j], _mm512_cvtepi32_ps(lanes_i32<F::SIGNED>(hdr[j] + F::SC_AT + 16 * s)))
                               : d[j];
          sub[j] = F::MINS ? _mm512_mul_ps(dmin[j], _mm512_cvtepi32_ps(min_lanes<F>(hdr[j], s)))
                           : _mm512_setzero_ps();
          operands<F>(hdr[j] + F::HEADER + c * F::CHUNK, kk, v[j][0], v[j][1]);
        }
        const int64_t k0 = sb * F::SB + 32 * c + 8 * kk;
        for (int h = 0; h < 2; ++h) {
          for (int t = 0; t < 4; ++t) {
            __m512 w[NB];
            for (int j = 0; j < NB; ++j) {
              const __m512i q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v[j][h], 8 * t), byte), off);
              w[j] = _mm512_mul_ps(scale[j], _mm512_cvtepi32_ps(q));
              if constexpr (F::MINS) w[j] = _mm512_sub_ps(w[j], sub[j]);
            }
            for (int i = 0; i < MT; ++i) {
              const __m512 xb = _mm512_set1_ps(xr[i][k0 + 4 * h + t]);
              for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
            }
          }
        }
      }
    }
  }
  block_gemm::store<int32_t, MT, NB>(a, m0, g0, acc);
}

#if TOKENMILL_KQ_VNNI
// The VNNI path: rows m0 .. m0+MT of quantized x times groups g0 .. g0+NB; pf, if not
// null, the next task's groups (pf_bytes), fetched into L2 meanwhile (q4_gemm's rule).
// One row sums a chunk's low and high operands apart (two dependency chains a group,
// where one row gives too few to hide vpdpbusd's latency) and adds them at the fold.
template <class F, int MT, int NB>
void tile_vnni(const Args& a, int64_t m0, int64_t g0, const uint8_t* pf, int64_t pf_bytes) {
  constexpr bool kSplit = MT == 1;
  constexpr int64_t TPB = KqTerms<F>::kPerBlock;
  const int64_t sbs = a.K / F::SB, group_bytes = sbs * F::BYTES;
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int8_t* xr[MT];
  const int32_t* tr[MT];
  for (int i = 0; i < MT; ++i) {
    xr[i] = a.xq + (m0 + i) * a.K;
    tr[i] = a.xt + (m0 + i) * sbs * TPB;
  }
  const char* pp = reinterpret_cast<const char*>(pf);
  for (int64_t sb = 0; sb < sbs; ++sb) {
    const char* const pend = pf ? reinterpret_cast<const char*>(pf) + pf_bytes * (sb + 1) / sbs : nullptr;
    const uint8_t* hdr[NB];
    for (int j = 0; j < NB; ++j) hdr[j] = a.w + (g0 + j) * group_bytes + sb * F::BYTES;
    __m512i isum[MT][NB], dot[MT][NB], dot_hi[MT][NB];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NB; ++j) isum[i][j] = dot[i][j] = dot_hi[i][j] = _mm512_setzero_si512();
    // Sub-block s's dot products into isum: sc (dot - OFF sum(xq)), exact in int32.
    auto fold = [&](int64_t s) {
      __m512i sc[NB];
      if constexpr (F::SCALES)
        for (int j = 0; j < NB; ++j) sc[j] = lanes_i32<F::SIGNED>(hdr[j] + F::SC_AT + 16 * s);
      for (int i = 0; i < MT; ++i) {
        for (int j = 0; j < NB; ++j) {
          __m512i t = dot[i][j];
          if constexpr (kSplit) t = _mm512_add_epi32(t, dot_hi[i][j]);
          if constexpr (F::OFF != 0) t = _mm512_add_epi32(t, bcast4(tr[i] + sb * TPB + s));  // - OFF sum(xq)
          if constexpr (F::SCALES) t = _mm512_mullo_epi32(t, sc[j]);
          isum[i][j] = _mm512_add_epi32(isum[i][j], t);
          dot[i][j] = dot_hi[i][j] = _mm512_setzero_si512();
        }
      }
    };
    for (int64_t c = 0; c < F::SB / 32; ++c) {
      const uint8_t* chunk[NB];
      for (int j = 0; j < NB; ++j) chunk[j] = hdr[j] + F::HEADER + c * F::CHUNK;
      for (int kk = 0; kk < 4; ++kk) {
        __m512i lo[NB], hi[NB];
        for (int j = 0; j < NB; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(chunk[j] + 64 * kk + kPrefetchBytes), _MM_HINT_T0);
          operands<F>(chunk[j], kk, lo[j], hi[j]);
        }
        for (int i = 0; i < MT; ++i) {
          const int8_t* xp = xr[i] + sb * F::SB + 32 * c + 8 * kk;
          const __m512i xlo = bcast4(xp), xhi = bcast4(xp + 4);
          for (int j = 0; j < NB; ++j) {
            dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], lo[j], xlo);
            if constexpr (kSplit) dot_hi[i][j] = _mm512_dpbusd_epi32(dot_hi[i][j], hi[j], xhi);
            else dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], hi[j], xhi);
          }
        }
        if (F::SUB == 16 && kk % 2 == 1) fold(2 * c + kk / 2);
        for (int j = 0; j < NB; ++j) {
          if (pp < pend) {
            _mm_prefetch(pp, _MM_HINT_T1);
            pp += 64;
          }
        }
      }
      if (F::SUB == 32) fold(c);
    }
    for (; pp < pend; pp += 64) _mm_prefetch(pp, _MM_HINT_T1);
    for (int j = 0; j < NB; ++j) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr[j])));
      for (int i = 0; i < MT; ++i) {
        const float xs = a.xs[(m0 + i) * sbs + sb];
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][j]), _mm512_mul_ps(d, _mm512_set1_ps(xs)), acc[i][j]);
        if constexpr (F::MINS) {  // dmin s sum_s mn sum(xq): integers until the one product
          __m512i msum = _mm512_setzero_si512();
          for (int64_t p = 0; p < F::NSUB / 2; ++p)
            msum = _mm512_dpwssd_epi32(msum, min_pair<F>(hdr[j], p), bcast4(tr[i] + sb * TPB + p));
          const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr[j] + 32)));
          acc[i][j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, _mm512_set1_ps(xs)), acc[i][j]);
        }
      }
    }
  }
  block_gemm::store<int32_t, MT, NB>(a, m0, g0, acc);
}
#endif

template <class F, bool VNNI, int MT>
void rows(const Args& a, int64_t m0, int64_t g0, int nb, const uint8_t* pf, int64_t pf_bytes) {
#if TOKENMILL_KQ_VNNI
  if constexpr (VNNI) {
    if constexpr (MT >= 3) {  // (3 groups would take more than the 32 registers)
      if (nb >= 2) tile_vnni<F, MT, 2>(a, m0, g0, pf, pf_bytes);
      else tile_vnni<F, MT, 1>(a, m0, g0, pf, pf_bytes);
      if (nb == 3) tile_vnni<F, MT, 1>(a, m0, g0 + 2, nullptr, 0);
    } else if (nb == 3) {
      tile_vnni<F, MT, 3>(a, m0, g0, pf, pf_bytes);
    } else if (nb == 2) {
      tile_vnni<F, MT, 2>(a, m0, g0, pf, pf_bytes);
    } else {
      tile_vnni<F, MT, 1>(a, m0, g0, pf, pf_bytes);
    }
    return;
  }
#else
  (void)pf;
  (void)pf_bytes;
#endif
  if (nb == 3) tile_float<F, MT, 3>(a, m0, g0);
  else if (nb == 2) tile_float<F, MT, 2>(a, m0, g0);
  else tile_float<F, MT, 1>(a, m0, g0);
}
#endif

// Rows [0, M) times groups g0 .. g0+nb (<= kMaxGroups), in row tiles (VNNI up to 4, float 4):
// the first tile reads the groups from memory (and fetches the next task), the others from L2.
template <class F>
void task(const Args& a, int64_t M, int64_t g0, int nb, bool vnni) {
#if TOKENMILL_KQ_AVX512
  if (vnni) {
    const int64_t groups = (a.N + 15) / 16, group_bytes = a.K / F::SB * F::BYTES;
    const int64_t next = std::min<int64_t>(kMaxGroups, groups - (g0 + nb));
    const uint8_t* pf = next > 0 ? a.w + (g0 + nb) * group_bytes : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const uint8_t* p = m0 == 0 ? pf : nullptr;
      const int64_t pb = p ? next * group_bytes : 0;
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: rows<F, true, 4>(a, m0, g0, nb, p, pb); break;
        case 3: rows<F, true, 3>(a, m0, g0, nb, p, pb); break;
        case 2: rows<F, true, 2>(a, m0, g0, nb, p, pb); break;
        default: rows<F, true, 1>(a, m0, g0, nb, p, pb); break;
      }
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: rows<F, false, 4>(a, m0, g0, nb, nullptr, 0); break;
      case 3: rows<F, false, 3>(a, m0, g0, nb, nullptr, 0); break;
      case 2: rows<F, false, 2>(a, m0, g0, nb, nullptr, 0); break;
      default: rows<F, false, 1>(a, m0, g0, nb, nullptr, 0); break;
    }
  }
#else  // the float path's sums, one lane at a time
  (void)vnni;
  const int64_t sbs = a.K / F::SB, group_bytes = sbs * F::BYTES;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = g0; g < g0 + nb; ++g)
      for (int l = 0; l < 16 && g * 16 + l < a.N; ++l) {
        float acc = 0.f;
        for (int64_t sb = 0; sb < sbs; ++sb)
          for (int64_t k = 0; k < F::SB; ++k)
            acc = std::fma(a.x[m * a.K + sb * F::SB + k], weight_at<F>(a.w + g * group_bytes + sb * F::BYTES, l, k), acc);
        block_gemm::store_one(a, m, g * 16 + l, acc);
      }
#endif
}

}  // namespace kq

// A format's row of block_gemm.h's driver: x quantized per super-block (kActBlock: 32,
// or 256 as llama.cpp's Q8_K), with the sub-blocks' sums of xq as the terms (KqTerms).
template <class F>
struct KqFormat {
  static constexpr const char* kName = F::kName;
  static constexpr bool kVnni = TOKENMILL_KQ_VNNI;
  using Term = int32_t;
  static constexpr int64_t kActBlock = F::SB, kTermsPerBlock = kq::KqTerms<F>::kPerBlock;
  static void terms(float, int32_t total, const int8_t* xq, int32_t* out) { kq::KqTerms<F>::of(total, xq, out); }
  static int64_t group_bytes(int64_t K) { return K / F::SB * F::BYTES; }
  // This thread's tasks [t0, t1), each fetching the next one into L2 as it runs (int8 path).
  static void tasks(const kq::Args& a, int64_t M, int64_t t0, int64_t t1, int64_t groups, bool vnni) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * kq::kMaxGroups;
      kq::task<F>(a, M, g0, static_cast<int>(std::min<int64_t>(kq::kMaxGroups, groups - g0)), vnni);
    }
  }
};

#define TOKENMILL_KQ_ENTRIES(lower, F)                                                               \
  at::Tensor lower##_gemm(at::Tensor x, const PackedWeight& w, bool float32_out, const KvStreams&,  \
                          const GemmSide* side) {                                                    \
    return block_gemm::gemm<KqFormat<F>>(std::move(x), w, float32_out, side);                        \
  }                                                                                                  \
  at::Tensor lower##_gemm_silu(at::Tensor x, const PackedWeight& w, const KvStreams&) {              \
    return block_gemm::gemm_silu<KqFormat<F>>(std::move(x), w);                                      \
  }
TOKENMILL_KQ_ENTRIES(q4_0, kq::Q4_0)
TOKENMILL_KQ_ENTRIES(q5_0, kq::Q5_0)
TOKENMILL_KQ_ENTRIES(q4_k, kq::Q4_K)
TOKENMILL_KQ_ENTRIES(q5_k, kq::Q5_K)
TOKENMILL_KQ_ENTRIES(q6_k, kq::Q6_K)
#undef TOKENMILL_KQ_ENTRIES
