// Paged decode attention for the CPU: one query token per request, reading
// K/V in place from the paged cache (no gathered copy of the context).
//
//   q            [num_decodes, num_heads, head_dim]        (float32 or bfloat16)
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_decodes, max_num_blocks] int64
//   seq_lens     [num_decodes] int64   (the query sits at position seq_len - 1)
//   -> out       [num_decodes, num_heads, head_dim]
//
// Scores, softmax and the weighted sum are accumulated in float32.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

// Rows of the cache are converted to float32 into a small buffer first, so the
// dot products and sums below run on plain floats (vectorised). bfloat16 is the
// top half of a float32: the conversion is a 16-bit shift.
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
static void paged_decode_impl(const at::Tensor& q, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              double scale, int64_t sliding_window, at::Tensor& out) {
  const int64_t num_decodes = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  // Strides in elements (all inputs are contiguous).
  const int64_t kv_stride = num_blocks * block_size * num_kv_heads * head_dim;  // K -> V
  const int64_t block_stride = block_size * num_kv_heads * head_dim;
  const int64_t row_stride = num_kv_heads * head_dim;  // one token: all KV heads

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = k_base + kv_stride;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
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
    std::vector<float> row(row_stride);
    to_float(q_ptr + b * num_heads * head_dim, qf.data(), num_heads * head_dim);
    for (float& x : qf) x *= fscale;
    // scores[head][t] = q_head . k_{kv head of head}[t]
    for (int64_t t = first; t < seq_len; ++t) {
      const int64_t block = bt[b * max_blocks + t / block_size];
      to_float(k_base + block * block_stride + (t % block_size) * row_stride, row.data(), row_stride);
      for (int64_t head = 0; head < num_heads; ++head)
        scores[head * n + (t - first)] =
            dot(&qf[head * head_dim], &row[(head / group) * head_dim], head_dim);
    }
    for (int64_t head = 0; head < num_heads; ++head) {  // softmax, in float32
      float* sh = &scores[head * n];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) m = std::max(m, sh[i]);
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) { sh[i] = std::exp(sh[i] - m); sum += sh[i]; }
      const float inv = 1.f / sum;
      for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
    }
    for (int64_t t = first; t < seq_len; ++t) {  // acc[head] += p[head][t] * v[t]
      const int64_t block = bt[b * max_blocks + t / block_size];
      to_float(v_base + block * block_stride + (t % block_size) * row_stride, row.data(), row_stride);
      for (int64_t head = 0; head < num_heads; ++head)
        axpy(scores[head * n + (t - first)], &row[(head / group) * head_dim], &acc[head * head_dim],
             head_dim);
    }
    for (int64_t i = 0; i < num_heads * head_dim; ++i)
      out_ptr[b * num_heads * head_dim + i] = static_cast<scalar_t>(acc[i]);
  }
}

at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode runs on the CPU");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, kv_heads, head_dim]");
  q = q.contiguous();
  kv_cache = kv_cache.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    paged_decode_impl<float>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    paged_decode_impl<at::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, sliding_window, out);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}
