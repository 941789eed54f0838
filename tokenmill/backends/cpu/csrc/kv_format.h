// The KV cache's stored formats (model/kv_format.py is the Python side and the
// reference; both must write the same bits). A layer's cache is
//   [2, num_blocks, block_size, num_kv_heads, entry]
// where one head's entry is, by the tensor's dtype:
//   float32 / bfloat16   head_dim values of the model's dtype ("auto")
//   uint8                q8_0: head_dim / 32 blocks of 34 bytes, llama.cpp's
//                        block_q8_0: a float16 scale d, then 32 int8 q (x = d q)
//   float8_e4m3fn / e5m2 head_dim fp8 values, no scale (vLLM's fp8 with scale 1),
//                        saturated to the format's largest finite value
// q8_0 quantizes as llama.cpp does: d = max |x| / 127, q = round(x / d) (ties
// to even, as torch.round), d stored as float16 (rounded once, to nearest).
#pragma once

#include <torch/extension.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

enum class KvFormat { kPlain, kQ8_0, kFp8E4M3, kFp8E5M2 };

constexpr int64_t kQ8Values = 32, kQ8Bytes = 34;

inline KvFormat kv_format_of(const at::Tensor& kv_cache) {
  switch (kv_cache.scalar_type()) {
    case at::kByte: return KvFormat::kQ8_0;
    case at::kFloat8_e4m3fn: return KvFormat::kFp8E4M3;
    case at::kFloat8_e5m2: return KvFormat::kFp8E5M2;
    default: return KvFormat::kPlain;
  }
}

// One head's entry in bytes.
inline int64_t kv_entry_bytes(KvFormat f, int64_t head_dim, int64_t plain_bytes) {
  switch (f) {
    case KvFormat::kQ8_0: return head_dim / kQ8Values * kQ8Bytes;
    case KvFormat::kFp8E4M3:
    case KvFormat::kFp8E5M2: return head_dim;
    default: return head_dim * plain_bytes;
  }
}

// The cache's layout checked against q's head_dim; a clear error otherwise.
inline void check_kv_entry(const at::Tensor& kv_cache, int64_t head_dim, const char* who) {
  const KvFormat f = kv_format_of(kv_cache);
  TORCH_CHECK(f != KvFormat::kQ8_0 || head_dim % kQ8Values == 0, who,
              ": a q8_0 KV cache needs head_dim a multiple of 32, got ", head_dim);
  const int64_t want = kv_entry_bytes(f, head_dim, 1);  // (in the tensor's elements)
  TORCH_CHECK(kv_cache.size(4) == want, who, ": a KV cache entry of ", want, " for head_dim ", head_dim,
              ", got ", kv_cache.size(4));
}

inline float fp8_saturate(float x, KvFormat f) {
  const float mx = f == KvFormat::kFp8E4M3 ? 448.f : 57344.f;
  return std::isnan(x) ? x : std::min(mx, std::max(-mx, x));
}

// n values (a token's heads, n a multiple of head_dim) -> their entries at dst.
template <typename T>
inline void kv_encode(KvFormat f, const T* x, uint8_t* dst, int64_t n) {
  if (f == KvFormat::kQ8_0) {
    for (int64_t b = 0; b < n / kQ8Values; ++b, x += kQ8Values, dst += kQ8Bytes) {
      float v[kQ8Values], amax = 0.f;
      for (int64_t i = 0; i < kQ8Values; ++i) {
        v[i] = static_cast<float>(x[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      const c10::Half dh(d);
      std::memcpy(dst, &dh.x, 2);
      for (int64_t i = 0; i < kQ8Values; ++i)
        dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v[i] * id)));
    }
  } else if (f == KvFormat::kFp8E4M3) {
    for (int64_t i = 0; i < n; ++i) dst[i] = c10::Float8_e4m3fn(fp8_saturate(static_cast<float>(x[i]), f)).x;
  } else if (f == KvFormat::kFp8E5M2) {
    for (int64_t i = 0; i < n; ++i) dst[i] = c10::Float8_e5m2(fp8_saturate(static_cast<float>(x[i]), f)).x;
  } else {
    std::memcpy(dst, x, n * sizeof(T));
  }
}

// n values' entries at src (plain: T values) -> float32 (scalar; the reference
// the vector loads below match).
template <typename T>
inline void kv_decode(KvFormat f, const uint8_t* src, float* dst, int64_t n) {
  if (f == KvFormat::kQ8_0) {
    for (int64_t b = 0; b < n / kQ8Values; ++b, src += kQ8Bytes, dst += kQ8Values) {
      c10::Half dh;
      std::memcpy(&dh.x, src, 2);
      const float d = static_cast<float>(dh);
      for (int64_t i = 0; i < kQ8Values; ++i) dst[i] = d * static_cast<float>(static_cast<int8_t>(src[2 + i]));
    }
  } else if (f == KvFormat::kFp8E4M3) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(c10::Float8_e4m3fn(src[i], c10::Float8_e4m3fn::from_bits()));
  } else if (f == KvFormat::kFp8E5M2) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(c10::Float8_e5m2(src[i], c10::Float8_e5m2::from_bits()));
  } else {
    const T* s = reinterpret_cast<const T*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  }
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 values of a head's entry (chunk c of head_dim / 16) as float32, by format:
// what kv_decode gives, with one instruction stream per chunk.
struct KvQ8Load {
  static constexpr KvFormat format = KvFormat::kQ8_0;
  static inline __m512 load(const uint8_t* head, int c) {
    const uint8_t* blk = head + (c / 2) * kQ8Bytes;
    uint16_t dbits;
    std::memcpy(&dbits, blk, 2);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * (c & 1)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(_cvtsh_ss(dbits)));
  }
};

// fp8 -> float16 bits, exactly: e5m2 is float16's top byte; e4m3's 7 exponent
// and mantissa bits sit at float16's bits 13-7 (the value 2^-8 of e4m3's, any
// exponent, subnormals too), scaled back by 2^8 after the widening.
struct KvE5M2Load {
  static constexpr KvFormat format = KvFormat::kFp8E5M2;
  static inline __m512 load(const uint8_t* head, int c) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 16 * c)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  }
};
struct KvE4M3Load {
  static constexpr KvFormat format = KvFormat::kFp8E4M3;
  static inline __m512 load(const uint8_t* head, int c) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 16 * c)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.f));
  }
};
#endif
