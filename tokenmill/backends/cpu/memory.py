"""The memory the CPU kernels read in long streams: the KV cache and the
packed weights, on anonymous maps with transparent huge pages."""

from __future__ import annotations

import ctypes
import math
import mmap
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor on an anonymous memory map that asks for
    transparent huge pages (MADV_HUGEPAGE; Linux's default THP mode gives them
    only where asked): streams over 4 KiB pages read markedly slower
    (docs/perf-notes.md). The OS zero-fills pages on first touch,
    so an unused part costs no memory, unless `populate` faults them all in
    now (populate_pages)."""
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
    madvise(MADV_POPULATE_WRITE) on `num_threads` (torch's) threads at once,
    each a run of huge pages (ctypes lets go of the GIL for the call), since
    faulting is slow enough to be worth sharing out; where that call is refused
    (an older kernel), one written byte a page."""
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


def _glibc(name: str, argtypes: list[Any], restype: Any) -> Callable[..., Any] | None:
    """glibc's function `name` with its C signature, or None with another C library."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        f = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = argtypes, restype
    return f


def trim_heap() -> bool:
    """Have glibc return the free pages of every heap to the system
    (malloc_trim(0); it ignores the trim threshold process_settings.keep_freed_memory
    raised): memory freed but held by fragmentation, as loading's temporaries are
    (a 1B Q4_K_M GGUF: ~780 MiB). Well under a millisecond on a small heap. False
    (nothing done) with another C library."""
    malloc_trim = _glibc("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33)
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes glibc's heaps hold free (mallinfo2's fordblks, every arena), or None
    where the C library has no mallinfo2."""
    mallinfo2 = _glibc("mallinfo2", [], _MallInfo2)
    return None if mallinfo2 is None else int(mallinfo2().fordblks)
