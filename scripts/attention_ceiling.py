"""How far the bf16 decode attention kernel is from reading its K/V at the speed
the memory gives for the same access pattern. A probe kernel (compiled here)
reads every K and V row of every query's context in the kernel's order and
does nothing else, prefetching the next query's rows as the kernel does
(mode 1) or not (mode 0); the real kernel runs on the same block tables.
Default model's shapes (9 heads, 3 KV heads, head_dim 64), B=128, context 264,
8 layers of K/V so the caches are cold. SEQ=1: each request's blocks in order
(a fresh engine); default: blocks scattered (an engine after churn).

    PYTHONPATH=. .venv/bin/python scripts/attention_ceiling.py

Measured 2026-12-01 (ms per layer; the machine's speed drifts 10-30% between
runs): 2 threads, scattered blocks: probe with prefetch 0.96-0.98 (26-27 GB/s),
without 1.29-1.34, kernel 1.25-1.44; sequential blocks: probe 0.87-0.91
(28.5-29.7 GB/s), kernel 1.27-1.41. One thread: probe with prefetch 1.26-1.38,
kernel 2.2-2.5, kernel with its data in cache ~1.0: one thread's kernel time is
about its compute plus its memory time, not the larger of the two. Tried
without gain: prefetching evenly over the V pass too, a prefetch stream a fixed
number of rows ahead across queries (worse with 2 threads), T0 hints (worse).
The engine's KV cache is already in huge pages (numpy's calloc asks for them).
After group_scores (3 heads a pass over K; commit 66efa9f), one run: 2 threads
kernel 1.23 vs probe 0.88; one thread 2.04 vs 1.33.
"""
import os
import sys
import time

import numpy as np
import torch
from torch.utils.cpp_extension import load_inline

from tokenmill.model import cpu_kernels

PROBE = r"""
#include <torch/extension.h>
#include <immintrin.h>
at::Tensor touch(at::Tensor kv, at::Tensor bt, at::Tensor seq, int64_t mode) {
  const int64_t B = bt.size(0), max_blocks = bt.size(1), nb = kv.size(1), bs = kv.size(2);
  const int64_t row = kv.size(3) * kv.size(4), block_stride = bs * row, kv_bytes = nb * block_stride * 2;
  const char* base = reinterpret_cast<const char*>(kv.data_ptr<at::BFloat16>());
  const int64_t* t = bt.data_ptr<int64_t>(); const int64_t* lens = seq.data_ptr<int64_t>();
  at::Tensor out = at::zeros({B}, at::kFloat); float* o = out.data_ptr<float>();
  auto row_at = [&](int64_t b, int64_t i) { return base + (t[b * max_blocks + i / bs] * block_stride + (i % bs) * row) * 2; };
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    __m512i acc = _mm512_setzero_si512();
    const int64_t pn = b + 1 < B ? lens[b + 1] : 0;
    for (int64_t i = 0; i < lens[b]; ++i) {
      const char* k = row_at(b, i);
      for (int64_t off = 0; off < row * 2; off += 64)
        acc = _mm512_xor_si512(acc, _mm512_xor_si512(_mm512_loadu_si512(k + off), _mm512_loadu_si512(k + kv_bytes + off)));
      if (mode && i < pn) {
        const char* p = row_at(b + 1, i);
        for (int64_t off = 0; off < row * 2; off += 64) { _mm_prefetch(p + off, _MM_HINT_T1); _mm_prefetch(p + kv_bytes + off, _MM_HINT_T1); }
      }
    }
    o[b] = (float)_mm512_reduce_add_epi32(acc);
  }
  return out;
}
"""
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
probe = load_inline(name="tokenmill_attention_probe", cpp_sources=[PROBE], functions=["touch"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
kernel = cpu_kernels.paged_decode_kernel()
B, L, bs, H, KV, D, layers = 128, 264, 16, 9, 3, 64, 8
nb = -(-L // bs)
torch.manual_seed(0)
# Allocated as the engine allocates its KV cache (numpy's calloc, which asks Linux
# for huge pages), then filled.
kvs = [torch.from_numpy(np.zeros(2 * (B * nb + 1) * bs * KV * D * 2, dtype=np.uint8))
       .view(torch.bfloat16).view(2, B * nb + 1, bs, KV, D) for _ in range(layers)]
for kv in kvs:
    kv.normal_()
order = torch.arange(B * nb) if os.environ.get("SEQ") == "1" else torch.randperm(B * nb + 1)[: B * nb]
bt = order.reshape(B, nb)
seq = torch.full((B,), L, dtype=torch.int64)
q = torch.randn(B, H, D).to(torch.bfloat16)
E = torch.empty(0, dtype=torch.int64)
gb = 2 * B * L * KV * D * 2 / 1e9
runs = {"probe, no prefetch": lambda kv: probe.touch(kv, bt, seq, 0),
        "probe, prefetch": lambda kv: probe.touch(kv, bt, seq, 1),
        "kernel": lambda kv: kernel(q, kv, bt, seq, 0.125, 0, E)}
for threads in (1, 2):
    torch.set_num_threads(threads)
    best = {name: float("inf") for name in runs}
    for _ in range(5):
        for name, fn in runs.items():
            t = time.perf_counter()
            for kv in kvs:
                fn(kv)
            best[name] = min(best[name], (time.perf_counter() - t) / layers)
    for name, d in best.items():
        print(f"{threads} thread(s) {name:20s} {d * 1e3:.3f} ms a layer, {gb / d:.1f} GB/s")
