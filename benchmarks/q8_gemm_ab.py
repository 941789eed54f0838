"""A/B of two kernel builds' q8_gemm over the default model's 120 projections + head, alternating (a process each run), min of R rounds: PYTHONPATH=. python benchmarks/q8_gemm_ab.py name_a,name_b [1,4]."""

# name_a, name_b: builds as kernels.load() names them (tokenmill_cpu_kernels_<digest>),
# found under $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions); name@tree
# packs the weights with that source tree's formats.pack (its PYTHONPATH: a
# build of another layout than this tree's). Random
# Q8_0 weights, distinct for each of the 30 layers (cold, as in a decode step),
# bf16 x (the served path: VNNI). Checks first that both builds give the same
# bits. A step: every projection then the head, one call each, in layer order.

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from types import ModuleType

import torch

from tokenmill.backends.cpu import formats

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): qkv, o, gate_up, down
HEAD = (576, 49152)
LAYERS = 30


def load_module(name: str) -> ModuleType:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions/py*_cpu")
    paths = glob.glob(f"{root}/{name}/{name}.so")
    if not paths:
        raise SystemExit(f"no build named {name} under {root}")
    spec = importlib.util.spec_from_file_location(name, paths[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def q8(mod: ModuleType, n: int, k: int) -> object:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d = (torch.rand(n, k // 32) * 1e-3 + 1e-4).to(torch.float16)
    return formats.pack(mod, "q8_0", (q, d))  # type: ignore[arg-type]


def one(name: str, row_counts: list[int]) -> None:
    """In a process of its own (two builds cannot share one: their pybind types
    collide): one warm step, then the best of 3 timed, a row count; prints JSON."""
    mod = load_module(name)
    torch.manual_seed(0)
    layers = [[q8(mod, n, k) for k, n in SHAPES] for _ in range(LAYERS)]
    head = q8(mod, HEAD[1], HEAD[0])
    result = {}
    for m in row_counts:
        xs = {k: (torch.randn(m, k) * 0.5).to(torch.bfloat16) for k in (576, 1536)}

        def step(xs: dict[int, torch.Tensor] = xs) -> list[torch.Tensor]:
            out = []
            for layer in layers:
                for packed, (k, _) in zip(layer, SHAPES, strict=True):
                    out.append(mod.packed_gemm(xs[k], packed, False))
            out.append(mod.packed_gemm(xs[HEAD[0]], head, True))
            return out

        digest = hashlib.sha256(b"".join(t.view(torch.uint8).numpy().tobytes() for t in step())).hexdigest()[:16]
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - t0)
        result[str(m)] = [best, digest]
    print(json.dumps(result))


def main() -> None:
    if sys.argv[1] == "--one":
        one(sys.argv[2], [int(r) for r in sys.argv[3].split(",")])
        return
    rounds = int(os.environ.get("R", 7))
    names = sys.argv[1].split(",")
    rows = sys.argv[2] if len(sys.argv) > 2 else "1,4"
    weights = sum(k * n for k, n in SHAPES) * LAYERS + HEAD[0] * HEAD[1]
    nbytes = weights // 32 * 34
    print(f"{LAYERS * len(SHAPES)} projections + head, bf16 x: {nbytes / 1e6:.0f} MB of Q8_0 blocks; "
          f"{rounds} rounds of {', '.join(names)} alternating")
    runs: dict[str, list[dict[str, list]]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in names:
            build, _, tree = name.partition("@")
            env = dict(os.environ, PYTHONPATH=tree) if tree else None
            out = subprocess.run([sys.executable, __file__, "--one", build, rows], check=True,
                                 capture_output=True, text=True, env=env).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    for m in rows.split(","):
        digests = {name: {r[m][1] for r in runs[name]} for name in names}
        print(f"rows {m}: output digests {digests} (same bits: {len(set.union(*digests.values())) == 1})")
        for name in names:
            ts = [r[m][0] for r in runs[name]]
            best = min(ts)
            print(f"rows {m}: {name}: min {best * 1e3:.2f} ms ({nbytes / best / 1e9:.1f} GB/s), "
                  f"all {' '.join(f'{t * 1e3:.2f}' for t in ts)}")


if __name__ == "__main__":
    main()
