"""Process-wide settings the engine makes once it is built (LLMEngine.__init__,
after the model is loaded): they serve a long-lived engine, and they apply to
the whole process, the caller's objects and allocations included."""

from __future__ import annotations

import ctypes
import gc
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def freeze_gc_heap() -> None:
    """Move everything alive now to the collector's permanent generation, as
    vLLM does after building its engine. The heap at this point (torch,
    transformers, the model, the tokenizer, the block pool: ~320K tracked
    objects with the default model) lives as long as the engine, yet every
    full collection walked all of it: 150-220 ms a pause on a Zen 5, one every
    ~100-200 steps of 128 requests decoding there, and every running request
    stalls for it (a stream's inter-token latency, a new request's time to
    first token). After the freeze a full collection walks only what came
    later (measured: 155 ms -> 0.002 ms right after start). Frozen objects are
    still freed when their last reference goes; only a reference cycle among
    them would stay, and the engine's own objects form none (an LLM is freed
    without the collector; AsyncEngine breaks its one cycle at shutdown). The freeze is
    process-wide: the caller's objects alive at that moment are frozen too (as
    with vLLM's worker when it runs in the caller's process); `gc.unfreeze()`
    undoes it."""
    gc.collect()
    gc.freeze()


def keep_freed_memory() -> bool:
    """glibc's malloc: no allocation of its own through mmap, and freed heap
    memory kept rather than given back to the system; False (nothing done)
    with another C library. By default glibc maps every block above a
    threshold (at most 32 MiB) fresh and unmaps it when freed, so the large
    activations of a big prefill step (at 8192 tokens the layers allocate
    ~48 MB a layer) came back as new pages every layer: 368,670 page faults
    (1.4 GiB zeroed) a step of 64 x 128 prompt tokens. Measured on a Zen 5
    (scripts/prefill_step.py, the code before and after alternating
    processes, ms a step): 64 x 128 tokens 2845 / 3008 -> 2383 / 2606, 128 x
    128 5797 / 6583 -> 4757 / 5158; 16 x 128 (the default token budget, no
    faults before either) 694 / 621 vs 654 / 778, the same. The cost is that
    the heap stays at its peak (the biggest step's activations) instead of
    shrinking after it; set after the model is loaded so that loading's
    temporaries are given back as before. Threads' arenas still map blocks
    above 64 MiB."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
