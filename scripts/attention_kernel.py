"""The paged attention kernel alone, bf16, 9 heads / 3 KV heads / head_dim 64 (the
default model), 8 layers of KV so caches are cold: ms per layer and GB/s of K/V read.

    PYTHONPATH=. .venv/bin/python scripts/attention_kernel.py   (OMP_NUM_THREADS=1 for one core)
"""
import time, torch
from tokenmill.model import cpu_kernels
k = cpu_kernels.paged_decode_kernel(); print(cpu_kernels._failed)
E = torch.empty(0, dtype=torch.int64)
def K(q, kv, bt, seq):
    try: return k(q, kv, bt, seq, 0.125, 0, E)
    except TypeError: return k(q, kv, bt, seq, 0.125, 0)
torch.manual_seed(0)
for B, L in [(32, 264), (128, 264), (128, 640)]:
    bs = 16; nb = -(-L // bs); H, KV, D = 9, 3, 64
    kvs = [torch.randn(2, B * nb + 1, bs, KV, D).to(torch.bfloat16) for _ in range(8)]  # 8 layers: cold caches
    bt = torch.randperm(B * nb + 1)[: B * nb].reshape(B, nb)
    seq = torch.full((B,), L, dtype=torch.int64)
    q = torch.randn(B, H, D).to(torch.bfloat16)
    for kv in kvs: K(q, kv, bt, seq)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for kv in kvs: K(q, kv, bt, seq)
        ts.append((time.perf_counter() - t) / len(kvs))
    d = min(ts); gb = 2 * B * L * KV * D * 2 / 1e9
    print(f"B={B} L={L}: {d*1e3:.2f} ms per layer, {gb/d:.1f} GB/s")
