"""Process-wide settings for a long-lived engine, applied by the entry points
that want them (`LLM` unless told not to, the server), never by building an
engine: they change the whole process, the caller's objects included.
Measurements: docs/perf-notes.md."""

from __future__ import annotations

import ctypes
import gc
import platform

from tokenmill.backends.cpu.memory import trim_heap

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def apply_process_settings() -> None:
    """Both settings below; call once the model is loaded."""
    keep_freed_memory()
    freeze_gc_heap()


def freeze_gc_heap() -> None:
    """Move everything alive now to the collector's permanent generation (as vLLM
    does after start-up), so full collections stop walking the long-lived heap:
    each such pause stalls every running request. Frozen objects are still freed
    by reference counting; only a reference cycle among them stays, so the
    engine's objects form none. `gc.unfreeze()` undoes it."""
    gc.collect()
    gc.freeze()


def keep_freed_memory() -> bool:
    """glibc's malloc: no allocations of its own through mmap, and freed heap memory
    kept rather than given back, so a big step's activations reuse pages instead of
    faulting in fresh zeroed ones every layer. The heap then stays at its peak; call
    it after loading so loading's temporaries are still given back. False (nothing
    done) with another C library."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def give_back_freed_memory() -> bool:
    """Collect reference cycles (an exception's traceback can hold a request's
    big strings), then trim_heap(). For after a rare big request, so RSS falls
    back from its peak; not per step. False (only the collection done) with
    another C library."""
    gc.collect()
    return trim_heap()
