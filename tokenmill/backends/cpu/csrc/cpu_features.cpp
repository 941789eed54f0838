// The CPU-feature policy of the layer calls (layer_loop.cpp, layer_stack.cpp):
// the instruction set a dtype runs on, the CPU family where the K/V prefetch
// (kv_prefetch.h) was measured to pay, and whether a layer's K/V fits the L3.
#include <torch/extension.h>

#include "cpu_features.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

// Whether x's dtype runs on the AVX512-BF16 kernels, where the K/V prefetch
// was measured to pay; the AVX2 build's bf16 (float32 math) was slower with it.
bool avx512_bf16(const at::Tensor& x) {
#if defined(__AVX512BF16__)
  return x.scalar_type() == at::kBFloat16;
#else
  (void)x;
  return false;
#endif
}

// Whether this CPU is one where the projections' K/V prefetch was measured to
// pay: AMD's family 25, of which the Zen 4 has AVX512-BF16 (which the prefetch
// needs too: avx512_bf16; the Zen 3 is family 25 without it). On a Zen 5
// (family 26) it cost instead: the projections of a few dozen rows are bound
// by reading their weights there, and the extra K/V traffic slows them. Other
// CPUs (not measured) go without (docs/perf-notes.md).
bool kv_prefetch_pays() {
  static const bool pays = [] {
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx) || ebx != 0x68747541u)  // "Auth(enticAMD)"
      return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xf, family = base == 0xf ? base + ((eax >> 20) & 0xff) : base;
    return family == 25;
#else
    return false;
#endif
  }();
  return pays;
}

KvPrefetchMode kv_prefetch_mode(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "kv_prefetch: -1 (auto), 0 (off) or 1 (on), not ", mode);
  return static_cast<KvPrefetchMode>(mode);
}

// Whether the layer calls may prefetch in this mode (on this CPU, for kAuto).
bool kv_prefetch_on(KvPrefetchMode mode) {
  return mode == KvPrefetchMode::kAuto ? kv_prefetch_pays() : mode == KvPrefetchMode::kOn;
}

// This machine's L3 in bytes (Linux sysfs), or 0 where unknown.
int64_t l3_bytes() {
  static const int64_t bytes = [] {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index3/size");
    int64_t n = 0;
    char unit = 0;
    if (!(f >> n)) return int64_t(0);
    f >> unit;
    return unit == 'K' ? n << 10 : unit == 'M' ? n << 20 : n;
  }();
  return bytes;
}

// Whether a layer's K/V for these queries (the largest layer's: windows may
// differ) fits 3/4 of L3, where the prefetch of kv_prefetch.h pays.
bool kv_fits_l3(const std::vector<at::Tensor>& kv_caches, const std::vector<LayerWeights>& layers,
                const at::Tensor& seq_lens) {
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t* l = lens.data_ptr<int64_t>();
  int64_t kv_bytes = 0;
  for (size_t i = 0; i < kv_caches.size(); ++i) {
    const int64_t window = layers[i].sliding_window;
    int64_t rows = 0;
    for (int64_t j = 0; j < lens.numel(); ++j) rows += window > 0 ? std::min(l[j], window) : l[j];
    kv_bytes = std::max(kv_bytes, 2 * rows * kv_caches[i].stride(2) * kv_caches[i].element_size());
  }
  return kv_bytes <= l3_bytes() / 4 * 3;
}
