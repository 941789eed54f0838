"""Small C++ kernels for the CPU, compiled once per machine with torch's
cpp_extension (g++ and ninja), with the torch code as the fallback.

`make setup` builds them ahead of time; otherwise the first use builds them
(about a minute) into torch's extension cache. Set TOKENMILL_NO_CPP_KERNELS=1
(before the process starts) to use the portable torch code only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("tokenmill")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_decode.cpp", "fused_ops.cpp", "packed_gemm.cpp",
                                            "layer_stack.cpp")]
_HEADERS = [_CSRC / "cpu_vec.h", _CSRC / "no_gil.h", _CSRC / "kv_prefetch.h"]
_FUNCTIONS = ["paged_decode", "rms_norm", "fused_add_rms_norm", "rope_qkv_cache", "silu_and_mul",
              "argmax_rows", "packed_gemm", "packed_gemm_silu", "packed_gemm_dtypes", "packed_gemm_max_rows",
              "layer_stack",
              "layer_loop", "kv_prefetch_rows", "kv_prefetch_mode"]
# No fused multiply-adds where the source does not ask for them: float32
# results then round as torch's separate ops do. -fno-trapping-math (values
# unchanged: no reassociation, no contraction) lets GCC vectorise loops with
# a select in them on AVX2, where without masked instructions it keeps them
# scalar: silu_and_mul's clamp (scalar vdivss on a Zen 3 before).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]
_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


_enabled = True  # tests switch the kernels off to compare with the torch code
# Read once: the check runs for every kernel call (~300 per step).
_env_disabled = os.environ.get("TOKENMILL_NO_CPP_KERNELS", "") not in ("", "0")


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def _disabled() -> bool:
    return not _enabled or _env_disabled


def load() -> Any | None:
    """The compiled module, or None where it cannot be built (the reason is logged once)."""
    global _module, _failed
    if _disabled():
        return None
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load_inline

                # torch finds ninja on PATH; the `ninja` wheel puts it next to this Python.
                bin_dir = os.path.dirname(sys.executable)
                if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

                sources = [path.read_text() for path in _SOURCES]
                # The name carries a hash of the sources and flags, so an edit rebuilds them.
                headers = [path.read_text() for path in _HEADERS]
                digest = hashlib.sha256("\n".join(sources + headers + _CFLAGS).encode()).hexdigest()[:12]
                _module = load_inline(
                    name=f"tokenmill_cpu_kernels_{digest}",
                    cpp_sources=sources,
                    functions=_FUNCTIONS,
                    extra_cflags=_CFLAGS,
                    extra_include_paths=[str(_CSRC)],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as e:  # no compiler, no ninja, ...: the torch code serves
                _failed = f"{type(e).__name__}: {e}"
                logger.warning("C++ CPU kernels unavailable, using torch code: %s", _failed[:300])
    return _module


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    module = load()
    return None if module is None else module.paged_decode


def fused_ops(x: torch.Tensor) -> Any | None:
    """The module with rms_norm, fused_add_rms_norm, rope_qkv_cache and
    silu_and_mul (csrc/fused_ops.cpp) when they apply to `x` (a contiguous
    float32 or bfloat16 CPU tensor), else None: the caller runs its torch code."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not x.is_contiguous():
        return None
    return load()


def packed_gemm_ops(x: torch.Tensor) -> Any | None:
    """The module with packed_gemm when it applies to x (a 2-D CPU tensor,
    where the build has AVX2 and FMA or AVX512-BF16: float32, or bf16 with an
    even number of columns), else None."""
    if x.device.type != "cpu" or x.dim() != 2:
        return None
    if not (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.shape[1] % 2 == 0)):
        return None
    module = load()
    if module is None:
        return None
    global _packed_dtypes
    if _packed_dtypes is None:
        _packed_dtypes = frozenset(module.packed_gemm_dtypes())
    return module if str(x.dtype).removeprefix("torch.") in _packed_dtypes else None


_packed_dtypes: frozenset[str] | None = None


def packed_max_rows() -> int:
    """The most rows worth a packed_gemm call (past them torch's matmul is the
    faster: 4096 with AVX512-BF16, no limit in the AVX2 build; csrc/packed_gemm.cpp
    packed_gemm_max_rows), 0 without the kernels."""
    module = load()
    return 0 if module is None else int(module.packed_gemm_max_rows())


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor on an anonymous memory map that asks for
    transparent huge pages (MADV_HUGEPAGE; Linux's default THP mode gives them
    only where asked). The OS zero-fills its pages on first touch, so an unused
    part costs no memory, unless `populate` asks for all of them now
    (populate_pages). What the kernels read in long streams lives here:
    the KV cache (worker/model_runner.zeros says what 4 KiB pages cost the
    attention, and why it is populated) and the packed weights (pack_weight)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # (not a POSIX system)
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=dtype).view(shape)
    if populate:
        populate_pages(out)
    return out


MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (Python 3.11's mmap module has no name for it)
_POPULATE_CHUNK_BYTES = 2 << 20  # a huge page


def populate_pages(t: torch.Tensor, num_threads: int | None = None) -> None:
    """Fault in every page of a contiguous CPU tensor now, its contents unchanged:
    the kernel's madvise(MADV_POPULATE_WRITE) on `num_threads` (torch's) threads at
    once, each a run of huge pages (ctypes lets go of the GIL for the call);
    where that call is refused (an older kernel), one written byte a page."""
    num_bytes = t.numel() * t.element_size()
    if num_bytes == 0:
        return
    assert t.is_contiguous() and t.device.type == "cpu"
    threads = max(1, num_threads or torch.get_num_threads())
    chunk = -(-num_bytes // threads // _POPULATE_CHUNK_BYTES) * _POPULATE_CHUNK_BYTES
    ranges = [(lo, min(lo + chunk, num_bytes)) for lo in range(0, num_bytes, chunk)]
    refused: list[tuple[int, int]] = []

    def advise(lo: int, hi: int) -> None:
        if _madvise is None or _madvise(t.data_ptr() + lo, hi - lo, MADV_POPULATE_WRITE) != 0:
            refused.append((lo, hi))

    workers = [threading.Thread(target=advise, args=r) for r in ranges[1:]]
    for w in workers:
        w.start()
    advise(*ranges[0])
    for w in workers:
        w.join()
    flat = t.view(-1).view(torch.uint8)
    for lo, hi in refused:  # rewrite one byte of every 4 KiB page with itself
        page_bytes = flat[lo:hi:4096]
        page_bytes.copy_(page_bytes.clone())


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_madvise = _libc_madvise()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the layout packed_gemm reads front to back, zero rows
    padding N to a multiple of 16: bf16 (K even) [ceil(N/16), K/2, 16, 2] with
    packed[b, k // 2, j, k % 2] = weight[16 b + j, k]; float32
    [ceil(N/16), K, 16] with packed[b, k, j] = weight[16 b + j, k].

    On huge pages (mapped_zeros): float32 decode steps on a Zen 3 with the
    same weights on 4 KiB pages and on huge pages alternating step by step,
    medians of 12, ms: B=32 139.7 -> 134.6, B=64 252.9 -> 247.5 (faster in 8
    and 9 of the 12 pairs)."""
    n, k = weight.shape
    padded = -(-n // 16) * 16
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    if weight.dtype == torch.float32:
        packed = weight.reshape(padded // 16, 16, k).permute(0, 2, 1)
    else:
        packed = weight.reshape(padded // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    if packed.device.type != "cpu":
        return packed.contiguous()
    out = mapped_zeros(tuple(packed.shape), packed.dtype)
    out.copy_(packed)
    return out


def best_matmul_rate(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """GFLOP/s of x [rows, K] @ W^T over `shapes` ((K, N) pairs), weights hot: per
    shape the fastest of `repeats` calls by torch's matmul or packed_gemm,
    whichever is faster (a machine's compute ceiling, as `bench roofline` uses it)."""

    def fastest(f: Callable[[], object]) -> float:
        f()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        return best

    total_flop = total_s = 0.0
    with torch.inference_mode():
        for k, n in shapes:
            x = torch.randn(rows, k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype)
            best = fastest(functools.partial(torch.nn.functional.linear, x, w))
            ops = packed_gemm_ops(x)
            if ops is not None:
                kernel = functools.partial(ops.packed_gemm, x, pack_weight(w), n, torch.empty(0), False)
                best = min(best, fastest(kernel))
            total_s += best
            total_flop += 2.0 * rows * k * n
    return total_flop / total_s / 1e9
