// LoRA adapters' delta (model/lora.py says what it computes): each adapter of
// a step on its own rows, in the projection GEMM's own parallel region inside
// the layer loop (lora_gemm), or after it from the plan's Python loop
// (lora_delta), one kernel.
#include <torch/extension.h>

#include "layer_stack.h"
#include "no_gil.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "cpu_vec.h"
#define TOKENMILL_LORA_AVX512 1
#endif

// out[r] += ((x[r] A^T) * scale) B^T for each row r of each adapter of the step
// (a segmented GEMM: each adapter's rows against its own A and B), in two
// passes over the whole team: the shrink (h = x A^T * scale, a tile of up to
// kLoraRows rows by one panel of 16 ranks) and, after a barrier, the expand
// (a tile of rows by one part's panel of 64 outputs, out += h B^T). Each value
// is one float32 sum in one fixed order (each half of the inputs as
// lora_shrink_rows sums it, the halves added, then the part's ranks in turn),
// rounded once to out's dtype: a row's bits do not depend on
// the other rows of the step, on the tiles, or on the number of threads.
namespace {
constexpr int kLoraRows = 4;

#if TOKENMILL_LORA_AVX512
// out[0..m) += v, m <= 16, rounded to bf16 (nearest even) where out is bf16.
inline void lora_add_out(float* out, __m512 v, int m) {
  const __mmask16 k = static_cast<__mmask16>((1u << m) - 1);
  _mm512_mask_storeu_ps(out, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, out), v));
}
inline void lora_add_out(at::BFloat16* out, __m512 v, int m) {
  const __mmask16 k = static_cast<__mmask16>((1u << m) - 1);
  const __m512 o = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, out)), 16));
  const __m512i u = _mm512_castps_si512(_mm512_add_ps(o, v));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  _mm256_mask_storeu_epi16(out, k, _mm512_cvtepi32_epi16(r));  // (no NaN here: the sums are finite)
}
#endif

// h[r][0..16) = x[rows[r]][k0..k1) A_panel[k0..k1), for r < NR: the even
// inputs in turn and the odd inputs in turn (two chains of FMAs), then their sum.
template <int NR, typename T, typename W>
void lora_shrink_rows(const T* x, int64_t x_ld, const int64_t* rows, const W* a, int64_t k0, int64_t k1,
                      float* h, int64_t h_ld) {
  x += k0;
  a += k0 * kLoraRanks;
  const int64_t I = k1 - k0;
#if TOKENMILL_LORA_AVX512
  // bf16 rows widened once into a thread's scratch, so each step of k broadcasts from memory.
  const float* xr[NR];
  if constexpr (std::is_same_v<T, float>) {
    for (int r = 0; r < NR; ++r) xr[r] = x + rows[r] * x_ld;
  } else {
    thread_local std::vector<float> wide;
    wide.resize(static_cast<size_t>(kLoraRows * I));
    for (int r = 0; r < NR; ++r) {
      float* dst = wide.data() + r * I;
      const T* src = x + rows[r] * x_ld;
      int64_t k = 0;
      for (; k + 16 <= I; k += 16) _mm512_storeu_ps(dst + k, load16(src + k));
      for (; k < I; ++k) dst[k] = static_cast<float>(src[k]);
      xr[r] = dst;
    }
  }
  __m512 even[NR], odd[NR];
  for (int r = 0; r < NR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= I; k += 2) {
    const __m512 w0 = load16(a + k * kLoraRanks), w1 = load16(a + (k + 1) * kLoraRanks);
    for (int r = 0; r < NR; ++r) {
      even[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k]), w0, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k + 1]), w1, odd[r]);
    }
  }
  if (k < I) {
    const __m512 w0 = load16(a + k * kLoraRanks);
    for (int r = 0; r < NR; ++r) even[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k]), w0, even[r]);
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(h + r * h_ld, _mm512_add_ps(even[r], odd[r]));
#else
  for (int r = 0; r < NR; ++r) {
    const T* xr = x + rows[r] * x_ld;
    float even[kLoraRanks] = {}, odd[kLoraRanks] = {};
    for (int64_t k = 0; k < I; ++k) {
      const float xk = static_cast<float>(xr[k]);
      float* acc = k % 2 ? odd : even;
      for (int j = 0; j < kLoraRanks; ++j) acc[j] += xk * static_cast<float>(a[k * kLoraRanks + j]);
    }
    for (int j = 0; j < kLoraRanks; ++j) h[r * h_ld + j] = even[j] + odd[j];
  }
#endif
}

// out[rows[r]][0..m) += h[r][0..R) B_panel, m <= 64, for r < NR (the ranks in
// turn), where h = (the first half's sum + the second's) * scale.
template <int NR, typename T, typename W>
void lora_expand_rows(T* out, int64_t out_ld, const int64_t* rows, const W* b, int64_t R, const float* h0,
                      const float* h1, const float* scale, int64_t h_ld, int m) {
#if TOKENMILL_LORA_AVX512
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t j = 0; j < R; ++j) {
    __m512 w[4];
    for (int q = 0; q < 4; ++q) w[q] = load16(b + j * kLoraOuts + 16 * q);
    for (int r = 0; r < NR; ++r) {
      const __m512 hj = _mm512_set1_ps((h0[r * h_ld + j] + h1[r * h_ld + j]) * scale[j]);
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_fmadd_ps(hj, w[q], acc[r][q]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int q = 0; q < 4 && 16 * q < m; ++q)
      lora_add_out(out + rows[r] * out_ld + 16 * q, acc[r][q], std::min(16, m - 16 * q));
#else
  for (int r = 0; r < NR; ++r) {
    float acc[kLoraOuts] = {};
    for (int64_t j = 0; j < R; ++j) {
      const float hj = (h0[r * h_ld + j] + h1[r * h_ld + j]) * scale[j];
      for (int o = 0; o < kLoraOuts; ++o) acc[o] += hj * static_cast<float>(b[j * kLoraOuts + o]);
    }
    T* o = out + rows[r] * out_ld;
    for (int c = 0; c < m; ++c) o[c] = static_cast<T>(static_cast<float>(o[c]) + acc[c]);
  }
#endif
}

// The tiles above for nr (1 to kLoraRows) rows: a constant count, so the
// accumulators stay in registers.
template <typename T, typename W>
void lora_shrink(const T* x, int64_t x_ld, const int64_t* rows, int nr, const W* a, int64_t k0, int64_t k1,
                 float* h, int64_t h_ld) {
  switch (nr) {
    case 1: return lora_shrink_rows<1>(x, x_ld, rows, a, k0, k1, h, h_ld);
    case 2: return lora_shrink_rows<2>(x, x_ld, rows, a, k0, k1, h, h_ld);
    case 3: return lora_shrink_rows<3>(x, x_ld, rows, a, k0, k1, h, h_ld);
    default: return lora_shrink_rows<kLoraRows>(x, x_ld, rows, a, k0, k1, h, h_ld);
  }
}

template <typename T, typename W>
void lora_expand(T* out, int64_t out_ld, const int64_t* rows, int nr, const W* b, int64_t R, const float* h0,
                 const float* h1, const float* scale, int64_t h_ld, int m) {
  switch (nr) {
    case 1: return lora_expand_rows<1>(out, out_ld, rows, b, R, h0, h1, scale, h_ld, m);
    case 2: return lora_expand_rows<2>(out, out_ld, rows, b, R, h0, h1, scale, h_ld, m);
    case 3: return lora_expand_rows<3>(out, out_ld, rows, b, R, h0, h1, scale, h_ld, m);
    default: return lora_expand_rows<kLoraRows>(out, out_ld, rows, b, R, h0, h1, scale, h_ld, m);
  }
}

int64_t panels(int64_t n, int64_t width) { return (n + width - 1) / width; }

// The shrink's inputs in two fixed halves, [0, mid) and [mid, in), each its
// own tile (so one row's shrink runs on two threads), summed by the expand.
int64_t lora_half(int64_t in) { return in / 2; }

struct LoraShrinkTile {  // segment g's rows [row, row + 4) by its ranks' panel, one half of the inputs
  size_t g;
  int64_t row, panel;
  int half;
};
struct LoraExpandTile {  // segment g's rows [row, row + 4) by its part's outputs' chunk
  size_t g;
  int64_t row;
  size_t part;
  int64_t chunk;
};
// One adapter's rows of a call, with the raw pointers its tiles read (taken
// once a call: a tensor's data_ptr checks its type each time, measurably so
// at one row) and where its two halves of h [2][n][h_ld] start.
template <typename W>
struct LoraSegment {
  const LoraProjection* w;
  const int64_t* rows;
  int64_t n;
  const W *a, *b;
  const float* scale;
  int64_t h_at, h_ld;
};

// out[r] += the delta of x[r] for each adapter's rows r, as GemmSide work
// (formats.h): the shrink tiles before the GEMM's tiles (x only), the expand
// tiles after them, on y. Its segments, tiles and h in buffers the building
// thread keeps (no allocation a call); one job a thread at a time.
template <typename T, typename W>
class LoraDelta final : public GemmSide {
 public:
  LoraDelta(const T* x, int64_t x_ld, const std::vector<const LoraProjection*>& ws,
            const std::vector<const at::Tensor*>& rows)
      : x_(x), x_ld_(x_ld) {
    thread_local std::vector<LoraSegment<W>> segs;
    thread_local std::vector<LoraShrinkTile> shrinks;
    thread_local std::vector<LoraExpandTile> expands;
    thread_local std::vector<float> h;
    segs.clear();
    shrinks.clear();
    expands.clear();
    int64_t h_size = 0;
    for (size_t g = 0; g < ws.size(); ++g) {
      const LoraProjection& w = *ws[g];
      const int64_t n = rows[g]->numel(), h_ld = panels(w.rank, kLoraRanks) * kLoraRanks;
      segs.push_back({&w, rows[g]->data_ptr<int64_t>(), n, w.a.data_ptr<W>(), w.b.data_ptr<W>(),
                      w.scale.data_ptr<float>(), h_size, h_ld});
      h_size += 2 * n * h_ld;
      for (int64_t t = 0; t < n; t += kLoraRows) {
        for (int64_t p = 0; p < h_ld / kLoraRanks; ++p)
          for (int half = 0; half < 2; ++half) shrinks.push_back({g, t, p, half});
        for (size_t i = 0; i < w.parts.size(); ++i)
          for (int64_t c = 0; c < panels(w.parts[i].out_hi - w.parts[i].out_lo, kLoraOuts); ++c)
            expands.push_back({g, t, i, c});
      }
    }
    h.resize(static_cast<size_t>(h_size));  // (every value is written by the shrink)
    h_ = h.data();
    seg_ = segs.data();
    shrink_ = shrinks.data();
    expand_ = expands.data();
    n_shrink_ = static_cast<int64_t>(shrinks.size());
    n_expand_ = static_cast<int64_t>(expands.size());
  }

  bool wants_team() const override { return n_shrink_ + n_expand_ > 4; }

  void before() const override {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n_shrink_; ++i) {
      const LoraShrinkTile& s = shrink_[i];
      const LoraSegment<W>& sg = seg_[s.g];
      const int64_t in = sg.w->in, mid = lora_half(in), k0 = s.half ? mid : 0, k1 = s.half ? in : mid;
      lora_shrink(x_, x_ld_, sg.rows + s.row, static_cast<int>(std::min<int64_t>(kLoraRows, sg.n - s.row)),
                  sg.a + s.panel * in * kLoraRanks, k0, k1,
                  h_ + sg.h_at + (s.half * sg.n + s.row) * sg.h_ld + s.panel * kLoraRanks, sg.h_ld);
    }
  }

  void after(const at::Tensor& y) const override {
    T* const out = y.data_ptr<T>();
    const int64_t out_ld = y.stride(0);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_expand_; ++i) {
      const LoraExpandTile& e = expand_[i];
      const LoraSegment<W>& sg = seg_[e.g];
      const LoraPart& part = sg.w->parts[e.part];
      const int64_t rank = part.rank_hi - part.rank_lo, lo = part.out_lo + e.chunk * kLoraOuts;
      const float* h0 = h_ + sg.h_at + e.row * sg.h_ld + part.rank_lo;
      lora_expand(out + lo, out_ld, sg.rows + e.row, static_cast<int>(std::min<int64_t>(kLoraRows, sg.n - e.row)),
                  sg.b + part.offset + e.chunk * rank * kLoraOuts, rank, h0, h0 + sg.n * sg.h_ld,
                  sg.scale + part.rank_lo, sg.h_ld, static_cast<int>(std::min<int64_t>(kLoraOuts, part.out_hi - lo)));
    }
  }

 private:
  const T* x_;
  int64_t x_ld_;
  float* h_;
  const LoraSegment<W>* seg_;
  const LoraShrinkTile* shrink_;
  const LoraExpandTile* expand_;
  int64_t n_shrink_, n_expand_;
};

// The step's adapters with rows and weights for (layer, projection), checked
// against x [n, in] and `out` outputs; f(job) with their LoraDelta (as a
// GemmSide), typed by x's dtype and the adapters'. False where none is adapted.
template <typename F>
bool with_lora_delta(const at::Tensor& x, int64_t out, const LoraStep& lora, size_t layer, int projection, F f) {
  std::vector<const LoraProjection*> ws;
  std::vector<const at::Tensor*> rows;
  at::ScalarType wtype = at::kFloat;
  for (size_t g = 0; g < lora.adapters.size(); ++g) {
    const LoraProjection& w = lora.adapters[g]->projections[layer * kLoraProjections + projection];
    if (!w.a.defined() || lora.rows[g].numel() == 0) continue;
    TORCH_CHECK(w.in == x.size(1) && w.out == out, "lora_delta: adapter of ", w.in, " inputs and ", w.out,
                " outputs, rows of ", x.size(1), " and ", out);
    TORCH_CHECK(ws.empty() || w.a.scalar_type() == wtype, "lora_delta: the step's adapters in one dtype");
    wtype = w.a.scalar_type();
    ws.push_back(&w);
    rows.push_back(&lora.rows[g]);
  }
  if (ws.empty()) return false;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_delta: x [n, I], rows contiguous");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "lora_delta: float32 or bfloat16 rows");
  if (bf16 && wtype == at::kBFloat16)
    f(LoraDelta<at::BFloat16, at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(0), ws, rows));
  else if (bf16)
    f(LoraDelta<at::BFloat16, float>(x.data_ptr<at::BFloat16>(), x.stride(0), ws, rows));
  else if (wtype == at::kBFloat16)
    f(LoraDelta<float, at::BFloat16>(x.data_ptr<float>(), x.stride(0), ws, rows));
  else
    f(LoraDelta<float, float>(x.data_ptr<float>(), x.stride(0), ws, rows));
  return true;
}
}  // namespace

LoraProjection pack_lora_projection(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale,
                                    const at::Tensor& parts, at::ScalarType dtype) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat,
              "LoraAdapterWeights: float32 A, B and scale");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && b.size(1) == a.size(0) && scale.numel() == a.size(0),
              "LoraAdapterWeights: A [R, in], B [out, R], scale [R]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "LoraAdapterWeights: float32 or bfloat16 weights");
  const int64_t R = a.size(0), I = a.size(1), O = b.size(0), rp = panels(R, kLoraRanks);
  TORCH_CHECK(parts.dim() == 2 && parts.size(1) == 4 && parts.size(0) > 0,
              "LoraAdapterWeights: parts [P, 4] (out_lo, out_hi, rank_lo, rank_hi)");
  LoraProjection w;
  w.in = I, w.rank = R, w.out = O;
  const at::Tensor pt = parts.to(at::kLong).contiguous();
  int64_t b_size = 0;
  for (int64_t i = 0; i < pt.size(0); ++i) {
    const int64_t* q = pt.data_ptr<int64_t>() + 4 * i;
    TORCH_CHECK(0 <= q[0] && q[0] < q[1] && q[1] <= O && 0 <= q[2] && q[2] < q[3] && q[3] <= R,
                "LoraAdapterWeights: a part's outputs or ranks out of range");
    w.parts.push_back({q[0], q[1], q[2], q[3], b_size});
    b_size += panels(q[1] - q[0], kLoraOuts) * (q[3] - q[2]) * kLoraOuts;
  }
  // A^T in panels: a_packed[p][k][j] = A[16 p + j][k]; B_i^T in panels: [c][j][o] = B[lo + 64 c + o][rank_lo + j].
  at::Tensor ap = at::zeros({rp * kLoraRanks, I}, a.options());
  ap.narrow(0, 0, R).copy_(a);
  w.a = ap.view({rp, kLoraRanks, I}).transpose(1, 2).contiguous().to(dtype);
  at::Tensor bp = at::empty({b_size}, b.options());
  for (const LoraPart& part : w.parts) {
    const int64_t chunks = panels(part.out_hi - part.out_lo, kLoraOuts), rank = part.rank_hi - part.rank_lo;
    at::Tensor bt = at::zeros({chunks * kLoraOuts, rank}, b.options());
    bt.narrow(0, 0, part.out_hi - part.out_lo).copy_(b.slice(0, part.out_lo, part.out_hi).slice(1, part.rank_lo, part.rank_hi));
    bp.narrow(0, part.offset, chunks * rank * kLoraOuts).copy_(bt.view({chunks, kLoraOuts, rank}).transpose(1, 2).reshape(-1));
  }
  w.b = bp.to(dtype);
  w.scale = at::zeros({rp * kLoraRanks}, scale.options());
  w.scale.narrow(0, 0, R).copy_(scale.reshape(-1));
  return w;
}

LoraStep lora_step(std::vector<const LoraAdapterWeights*> adapters, std::vector<at::Tensor> rows, size_t layers,
                   int64_t num_rows) {
  TORCH_CHECK(adapters.size() == rows.size(), "lora: one row index tensor per adapter");
  for (size_t g = 0; g < adapters.size(); ++g) {
    TORCH_CHECK(adapters[g] && adapters[g]->projections.size() == layers * kLoraProjections,
                "lora: an adapter of ", layers, " layers");
    rows[g] = rows[g].to(at::kLong).contiguous();
    const int64_t* r = rows[g].data_ptr<int64_t>();
    for (int64_t i = 0; i < rows[g].numel(); ++i)
      TORCH_CHECK(r[i] >= 0 && r[i] < num_rows, "lora: row ", r[i], " of a step of ", num_rows, " rows");
  }
  return LoraStep{std::move(adapters), std::move(rows)};
}

at::Tensor lora_gemm(const at::Tensor& x, const PackedWeight& w, const KvStreams& kv, const LoraStep& lora,
                     size_t layer, int projection) {
  at::Tensor y;
  const bool adapted = with_lora_delta(x, w.n, lora, layer, projection,
                                       [&](const GemmSide& job) { y = packed_gemm(x, w, false, kv, &job); });
  return adapted ? y : packed_gemm(x, w, false, kv);
}

// out += the delta on its own (the plan's Python loop): the same kernel.
void lora_delta(at::Tensor out, at::Tensor x, std::vector<const LoraAdapterWeights*> lora_adapters,
                std::vector<at::Tensor> lora_rows, int64_t layer, int64_t projection) {
  TORCH_CHECK(projection >= 0 && projection < kLoraProjections, "lora_delta: projection 0 to 3");
  TORCH_CHECK(!lora_adapters.empty() && layer >= 0 &&
                  static_cast<size_t>(layer) < lora_adapters[0]->projections.size() / kLoraProjections,
              "lora_delta: a layer of the adapters");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "lora_delta: out [n, O] and x [n, I] of one dtype, rows contiguous");
  const size_t layers = lora_adapters[0]->projections.size() / kLoraProjections;
  const LoraStep step = lora_step(std::move(lora_adapters), std::move(lora_rows), layers, out.size(0));
  NoGil no_gil;
  with_lora_delta(x, out.size(1), step, static_cast<size_t>(layer), static_cast<int>(projection),
                  [&](const GemmSide& job) { job.alone(out); });
}
