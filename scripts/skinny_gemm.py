"""The skinny bf16 GEMM against torch over the 30 layers projections of the default
model (distinct weights per layer: cold, as in a real step), per batch size.

    PYTHONPATH=. .venv/bin/python scripts/skinny_gemm.py
"""
import time, torch
from tokenmill.model import cpu_kernels
m = cpu_kernels.load(); print(cpu_kernels._failed)
shapes=[(576,960),(576,576),(576,3072),(1536,576)]
L=30
dt=torch.bfloat16
torch.manual_seed(0)
ws=[[torch.randn(n,k,dtype=dt)*0.05 for k,n in shapes] for _ in range(L)]
x=torch.randn(5,576,dtype=dt); b=torch.randn(960,dtype=dt)
ref=torch.nn.functional.linear(x, ws[0][0], b); ours=m.skinny_gemm(x, ws[0][0], b, False)
print("maxdiff", (ref.float()-ours.float()).abs().max().item(), "ulp-ish differing:", (ref!=ours).float().mean().item())
for M in (1, 4, 8, 16, 32, 64, 96, 128):
    xs=[torch.randn(M,k,dtype=dt) for k,n in shapes]
    for name, f in (("torch", lambda x,w: torch.nn.functional.linear(x,w)), ("skinny", lambda x,w: m.skinny_gemm(x,w,torch.Tensor(),False))):
        def run():
            for l in range(L):
                for x_,w in zip(xs, ws[l]): f(x_,w)
        run(); ts=[]
        for _ in range(5):
            t=time.perf_counter(); run(); ts.append(time.perf_counter()-t)
        d=min(ts); by=sum(w.numel()*2 for w in ws[0])*L; fl=sum(2*M*k*n for k,n in shapes)*L
        print(f"{name:6s} M={M}: {d*1e3:.1f} ms -> {by/d/1e9:.1f} GB/s, {fl/d/1e9:.0f} GFLOP/s")
