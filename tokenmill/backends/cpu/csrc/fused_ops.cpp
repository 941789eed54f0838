// Fused elementwise ops for the CPU: each replaces a chain of small torch ops
// (one pass over memory instead of five to eight, and no temporaries).
//
// They round exactly where the torch code they replace rounds: in bfloat16 every
// torch op rounds its result to bfloat16, so e.g. RMSNorm normalises in float32,
// rounds, then multiplies by the weight and rounds again. Only the order of the
// float32 sums (the mean of squares) can differ.
//
//   rms_norm(x, w, eps)                    -> w * bf16(x * rsqrt(mean(x^2) + eps))
//                                             (w float32 with bf16 x: bf16(w * (x * rsqrt(...))),
//                                             scaled in float32, rounded once: HF Gemma's
//                                             RMSNorm, w then being its 1 + weight)
//   fused_add_rms_norm(x, residual, w, eps)   residual = x + residual; x = rms_norm(residual)
//   rope_qkv_cache(qkv, ..., q_norm, k_norm, eps)   rms_norm each head of q and k in place
//                                             where q_norm / k_norm are given (Qwen3, Gemma 3;
//                                             empty: none), rotate q and k inside qkv in place
//                                             (rotate_half RoPE), then store k, v at their cache slots
//                                             (in the cache's format: kv_format.h)
//   silu_and_mul(gate_up)                  -> silu(gate) * up
//   gelu_tanh_and_mul(gate_up)             -> gelu(gate, approximate="tanh") * up (GeGLU: Gemma)
//   q8_embed(qweight, qscale, ids, f32)    -> the Q8_0 table's rows for ids, dequantized
//   argmax_rows(logits)                    -> each row's first index of its largest value
//                                             (a NaN counts as largest), as torch.argmax;
//                                             parallel over rows
//   apply_token_bitmask(logits, bitmask, rows)   logits[r, t] = -inf where bit t of
//                                             bitmask[r] is 0 (xgrammar's layout: int32
//                                             words, bit t % 32 of word t / 32), for the
//                                             given rows, in place; parallel over rows
#include <torch/extension.h>

#include "kv_format.h"
#include "no_gil.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
// Round to the storage type (round to nearest even for bfloat16, as torch).
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline at::BFloat16 from_f<at::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  at::BFloat16 r;
  r.x = static_cast<uint16_t>(x != x ? 0x7fc0u : rounded);  // NaN stays NaN
  return r;
}
// The value after a round trip through the storage type.
template <typename T> inline float rnd(float x) { return to_f(from_f<T>(x)); }

// Parallel over rows only when there is enough work to pay for the threads.
inline bool worth_threads(int64_t elements) { return elements >= 16384; }

// The normalised value times the weight: a weight in x's dtype scales the
// normalised value rounded to that dtype (HF's Llama RMSNorm: w * x.to(dtype));
// a float32 weight with bf16 x scales the float32 value and rounds once (HF's
// Gemma RMSNorm: (x * (1 + w).float()).to(dtype), the plan holding 1 + w).
template <typename T, typename W>
inline T scaled(float normalised, W w) {
  if constexpr (std::is_same_v<T, W>) return from_f<T>(to_f(w) * rnd<T>(normalised));
  else return from_f<T>(to_f(w) * normalised);
}

// One row x -> o (o may be x: the q/k norms run in place).
template <typename T, typename W>
inline void norm_row(const T* x, T* o, const W* w, int64_t dim, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) o[i] = scaled<T>(to_f(x[i]) * inv, w[i]);
}

template <typename T, typename W>
void rms_norm_rows(const T* x, T* out, const W* w, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (worth_threads(rows * dim))
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * dim, out + r * dim, w, dim, eps);
}

template <typename T, typename W>
void add_rms_norm_rows(T* x, T* res, const W* w, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (worth_threads(rows * dim))
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * dim;
    T* rr = res + r * dim;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) {
      const float s = rnd<T>(to_f(xr[i]) + to_f(rr[i]));
      rr[i] = from_f<T>(s);
      ss += s * s;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) xr[i] = scaled<T>(to_f(rr[i]) * inv, w[i]);
  }
}

template <typename T, typename W>
void rope_qkv_cache_impl(at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slots,
                         const at::Tensor& q_norm, const at::Tensor& k_norm, float eps) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  // The cache in bytes, any stored format (kv_format.h): a slot holds every KV head.
  const KvFormat fmt = kv_format_of(kv_cache);
  const int64_t slot_size = num_kv_heads * head_dim;  // values
  const int64_t slot_bytes = num_kv_heads * kv_entry_bytes(fmt, head_dim, sizeof(T));
  const int64_t kv_bytes = kv_cache.numel() / 2 * kv_cache.element_size();  // K -> V
  T* base = qkv.data_ptr<T>();
  uint8_t* cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* cos_t = cos.data_ptr<float>();
  const float* sin_t = sin.data_ptr<float>();
  const W* qn = q_norm.numel() ? q_norm.data_ptr<W>() : nullptr;
  const W* kn = k_norm.numel() ? k_norm.data_ptr<W>() : nullptr;
#pragma omp parallel for if (worth_threads(tokens * width))
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = base + t * width;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {  // (per head, before RoPE, as Qwen3's attention)
      const W* w = h < num_heads ? qn : kn;
      if (w) norm_row(row + h * head_dim, row + h * head_dim, w, head_dim, eps);
    }
    // HF casts cos/sin to the model dtype first, then x' = x*cos + rotate_half(x)*sin,
    // each product and the sum rounded.
    const float* c = cos_t + pos[t] * half;
    const float* s = sin_t + pos[t] * half;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      T* x = row + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float ci = rnd<T>(c[i]), si = rnd<T>(s[i]);
        const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
        const float y1 = rnd<T>(rnd<T>(x1 * ci) + rnd<T>(-x2 * si));
        const float y2 = rnd<T>(rnd<T>(x2 * ci) + rnd<T>(x1 * si));
        x[i] = from_f<T>(y1);
        x[i + half] = from_f<T>(y2);
      }
    }
    const T* k = row + num_heads * head_dim;
    kv_encode(fmt, k, cache + slot[t] * slot_bytes, slot_size);
    kv_encode(fmt, k + slot_size, cache + kv_bytes + slot[t] * slot_bytes, slot_size);
  }
}

// exp(x) written so that the compiler vectorises the loops that call it (std::exp
// would stay scalar without -ffast-math): x = n ln2 + r, |r| <= ln2 / 2, a
// degree-7 polynomial for e^r, 2^n through the exponent bits. Relative error
// ~1e-7; x is clamped to [-87, 88].
inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  const float fn = std::nearbyint(x * 1.44269504088896341f);  // vectorises; roundf does not
  const int32_t n = static_cast<int32_t>(fn);
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
void silu_and_mul_impl(const T* in, T* out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (worth_threads(rows * inter))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = in + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = to_f(g[i]);
      o[i] = from_f<T>(rnd<T>(x / (1.f + exp_approx(-x))) * to_f(u[i]));
    }
  }
}

// tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|), in float32 with exp_approx
// (vectorises): absolute error ~1e-7, which is what its callers (GELU's 1 + tanh,
// a soft-cap's c * tanh) see.
inline float tanh_approx(float y) {
  const float e = exp_approx(-2.f * std::fabs(y));
  const float t = (1.f - e) / (1.f + e);
  return y < 0.f ? -t : t;
}

// torch's F.gelu(x, approximate="tanh") in float32, its operations in its order
// (ATen's GELU kernel): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
inline float gelu_tanh(float x) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  const float cube = x * x * x;
  const float inner = beta * (x + kappa * cube);
  return 0.5f * x * (1.f + tanh_approx(inner));
}

// GELU-tanh of every bf16 value, computed once by torch's own kernel (at::gelu): a
// bf16 gate has 65536 values, and a table of torch's results is its bits exactly,
// where any other tanh differs from torch's where 1 + tanh cancels (x << 0).
const uint16_t* gelu_tanh_bf16_table() {
  static uint16_t table[65536];
  static std::once_flag once;
  std::call_once(once, [] {
    at::Tensor x = at::empty({65536}, at::kBFloat16);  // every bit pattern
    uint16_t* xp = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
    for (uint32_t i = 0; i < 65536; ++i) xp[i] = static_cast<uint16_t>(i);
    const at::Tensor y = at::gelu(x, "tanh").contiguous();
    std::memcpy(table, y.data_ptr(), sizeof(table));
  });
  return table;
}

template <typename T>
void gelu_tanh_and_mul_impl(const T* in, T* out, int64_t rows, int64_t inter) {
  [[maybe_unused]] const uint16_t* table = nullptr;
  if constexpr (!std::is_same_v<T, float>) table = gelu_tanh_bf16_table();
#pragma omp parallel for if (worth_threads(rows * inter))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = in + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
    if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = gelu_tanh(g[i]) * u[i];
    } else {  // bf16(gelu(g)) * u, rounded: the reference's two ops
      for (int64_t i = 0; i < inter; ++i) {
        at::BFloat16 act;
        act.x = table[g[i].x];
        o[i] = from_f<T>(to_f(act) * to_f(u[i]));
      }
    }
  }
}

// The first index of the row's maximum: a vectorised pass for the maximum
// (x * 0 sums to NaN where a NaN or an infinity is in the row: then a plain
// scan decides), then the first chunk of 64 that holds it.
int64_t argmax_row(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity(), z = 0.f;
#pragma omp simd reduction(max : m) reduction(+ : z)
  for (int64_t i = 0; i < n; ++i) {
    m = m > x[i] ? m : x[i];
    z += x[i] * 0.f;
  }
  if (z != z) {  // NaN or infinities: torch's rule, a NaN is the largest
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] != x[i]) return i;
      if (x[i] > x[best]) best = i;
    }
    return best;
  }
  constexpr int64_t chunk = 64;
  for (int64_t c = 0; c < n; c += chunk) {
    const int64_t end = std::min(n, c + chunk);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c; i < end; ++i) hit |= x[i] == m;
    if (hit)
      for (int64_t i = c; i < end; ++i)
        if (x[i] == m) return i;
  }
  return 0;
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, " must be float32 or bfloat16");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  NoGil no_gil;
  check(x, "x");
  check(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "rms_norm: the weight in x's dtype or float32");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim, "rms_norm: a weight per column");
  at::Tensor out = at::empty_like(x);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), out.data_ptr<float>(), weight.data_ptr<float>(), rows, dim, e);
  else if (weight.scalar_type() == at::kFloat)  // (Gemma's: scaled in float32)
    rms_norm_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), weight.data_ptr<float>(), rows, dim, e);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                  weight.data_ptr<at::BFloat16>(), rows, dim, e);
  return out;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  NoGil no_gil;
  check(x, "x");
  check(residual, "residual");
  check(weight, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
              (weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat),
              "x, residual, weight disagree (the weight in x's dtype or float32)");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim, "fused_add_rms_norm: a weight per column");
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), rows, dim, e);
  else if (weight.scalar_type() == at::kFloat)  // (Gemma's: scaled in float32)
    add_rms_norm_rows(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(), weight.data_ptr<float>(),
                      rows, dim, e);
  else
    add_rms_norm_rows(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(),
                      weight.data_ptr<at::BFloat16>(), rows, dim, e);
}

void rope_qkv_cache(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                    at::Tensor slot_mapping, at::Tensor q_norm, at::Tensor k_norm, double eps) {
  NoGil no_gil;
  check(qkv, "qkv");
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.is_contiguous(), "kv_cache must be contiguous, on the CPU");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(kv_cache.scalar_type() == qkv.scalar_type() || kv_format_of(kv_cache) != KvFormat::kPlain,
              "kv_cache: qkv's dtype, or an 8-bit format (kv_format.h)");
  TORCH_CHECK(kv_cache.dim() == 5, "kv_cache must be [2, blocks, block_size, kv_heads, entry]");
  check_kv_entry(kv_cache, head_dim, "rope_qkv_cache");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head_dim / 2,
              "cos/sin must be contiguous float32 [positions, head_dim / 2]");
  positions = positions.to(at::kLong).contiguous();
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0),
              "one position and one slot per token");
  // (a float32 q/k norm weight with bf16 qkv: Gemma 3's, scaled in float32 as rms_norm says)
  const bool f32_norms = q_norm.numel() && q_norm.scalar_type() == at::kFloat;
  for (const at::Tensor* norm : {&q_norm, &k_norm})
    TORCH_CHECK(norm->numel() == 0 || (norm->numel() == head_dim && norm->is_contiguous() &&
                                       norm->scalar_type() == (f32_norms ? at::kFloat : qkv.scalar_type())),
                "q_norm / k_norm: empty, or [head_dim] contiguous, both in qkv's dtype or both float32");
  TORCH_CHECK((q_norm.numel() == 0) == (k_norm.numel() == 0), "q_norm and k_norm: both or neither");
  const float e = static_cast<float>(eps);
  if (qkv.scalar_type() == at::kFloat)
    rope_qkv_cache_impl<float, float>(qkv, num_heads, num_kv_heads, head_dim, positions, cos, sin,
                                      kv_cache, slot_mapping, q_norm, k_norm, e);
  else if (f32_norms)
    rope_qkv_cache_impl<at::BFloat16, float>(qkv, num_heads, num_kv_heads, head_dim, positions, cos, sin,
                                             kv_cache, slot_mapping, q_norm, k_norm, e);
  else
    rope_qkv_cache_impl<at::BFloat16, at::BFloat16>(qkv, num_heads, num_kv_heads, head_dim, positions, cos, sin,
                                                    kv_cache, slot_mapping, q_norm, k_norm, e);
}

at::Tensor argmax_rows(at::Tensor logits) {
  NoGil no_gil;
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "argmax_rows takes float32 [rows, n] on the CPU");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: rows of length 0");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  // A row is ~7 us on one thread; at a few rows, waking the pool costs more
  // than it saves (and far more when another process holds a core).
#pragma omp parallel for if (rows >= 8 && worth_threads(rows * n))
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(x + r * n, n);
  return out;
}

// Structured outputs' masks (worker/grammar.py): the same result as xgrammar's
// apply_token_bitmask_inplace, a word at a time (all allowed: skip; none: fill),
// which is what makes it a memory pass rather than a bit loop.
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  NoGil no_gil;
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous(),
              "apply_token_bitmask takes contiguous float32 logits [rows, vocab] on the CPU");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) >= logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask: bitmask must be contiguous int32 [>= rows, >= vocab / 32]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "apply_token_bitmask: rows int64 [n]");
  rows = rows.contiguous();
  const int64_t n = rows.size(0), vocab = logits.size(1), words = bitmask.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0), "apply_token_bitmask: row out of range");
  float* x = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for if (worth_threads(n * vocab))
  for (int64_t i = 0; i < n; ++i) {
    float* xr = x + row[i] * vocab;
    const uint32_t* br = bits + row[i] * words;
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      const uint32_t word = br[w];
      if (word == 0xffffffffu) continue;
      const int64_t base = w * 32, len = std::min<int64_t>(32, vocab - base);
      if (word == 0) {
        for (int64_t t = 0; t < len; ++t) xr[base + t] = neg_inf;
        continue;
      }
      for (int64_t t = 0; t < len; ++t)
        if (!((word >> t) & 1u)) xr[base + t] = neg_inf;
    }
  }
}

// The rows of a Q8_0 embedding table for `ids` (model/quantization.py
// embed_rows): each value float32 q * d (exact: 8 and 11 significant bits),
// rounded once to bfloat16 unless float32_out: the torch code's bits, in one
// op instead of its six (a decode step runs them with cold caches).
at::Tensor q8_embed(at::Tensor qweight, at::Tensor qscale, at::Tensor ids, bool float32_out) {
  NoGil no_gil;
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) % 32 == 0,
              "q8_embed: qweight must be contiguous int8 [vocab, k], k a multiple of 32");
  TORCH_CHECK(qscale.scalar_type() == at::kHalf && qscale.is_contiguous() &&
                  qscale.sizes() == at::IntArrayRef({qweight.size(0), qweight.size(1) / 32}),
              "q8_embed: qscale must be contiguous float16 [vocab, k / 32]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "q8_embed: ids int64 [n]");
  ids = ids.contiguous();
  const int64_t n = ids.size(0), k = qweight.size(1), vocab = qweight.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "q8_embed: id out of range");
  at::Tensor out = at::empty({n, k}, qweight.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  const int8_t* q = qweight.data_ptr<int8_t>();
  const at::Half* d = qscale.data_ptr<at::Half>();
  float* of = float32_out ? out.data_ptr<float>() : nullptr;
  at::BFloat16* ob = float32_out ? nullptr : out.data_ptr<at::BFloat16>();
#pragma omp parallel for if (worth_threads(n * k))
  for (int64_t i = 0; i < n; ++i) {
    const int8_t* qr = q + id[i] * k;
    const at::Half* dr = d + id[i] * (k / 32);
    for (int64_t j = 0; j < k; ++j) {
      const float v = static_cast<float>(qr[j]) * static_cast<float>(dr[j / 32]);
      if (of) of[i * k + j] = v;
      else ob[i * k + j] = from_f<at::BFloat16>(v);
    }
  }
  return out;
}

// act(gate) * up of each row of gate_up [..., 2 * inter] -> [..., inter], the
// elementwise `impl(gate_up, out, rows, inter)` for the tensor's dtype.
template <typename Impl>
static at::Tensor gated(const at::Tensor& gate_up, Impl impl) {
  NoGil no_gil;
  check(gate_up, "gate_up");
  const int64_t inter = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  at::Tensor out = at::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    impl(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  else
    impl(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
  return out;
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  return gated(gate_up, [](const auto* g, auto* o, int64_t rows, int64_t inter) {
    silu_and_mul_impl(g, o, rows, inter);
  });
}

void softcap_scores(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = tanh_approx(s[i] / cap) * cap;
}

// The bf16 GELU table built now (the plan calls it when it is built, outside
// the kernels' parallel regions, since at::gelu has its own).
void prepare_gelu_tanh() { gelu_tanh_bf16_table(); }

at::Tensor gelu_tanh_and_mul(at::Tensor gate_up) {
  return gated(gate_up, [](const auto* g, auto* o, int64_t rows, int64_t inter) {
    gelu_tanh_and_mul_impl(g, o, rows, inter);
  });
}
