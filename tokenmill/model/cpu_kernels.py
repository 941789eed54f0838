"""Small C++ kernels for the CPU, compiled once per machine with torch's
cpp_extension (g++ and ninja), with the torch code as the fallback.

`make setup` builds them ahead of time; otherwise the first use builds them
(about a minute) into torch's extension cache. Set TOKENMILL_NO_CPP_KERNELS=1
to use the portable torch code only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("tokenmill")

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "fused_ops.cpp")]
_FUNCTIONS = ["paged_decode", "rms_norm", "fused_add_rms_norm", "rope_qkv_cache", "silu_and_mul"]
_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


_enabled = True  # tests switch the kernels off to compare with the torch code


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def _disabled() -> bool:
    return not _enabled or os.environ.get("TOKENMILL_NO_CPP_KERNELS", "") not in ("", "0")


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
                # The name carries a hash of the sources, so an edit rebuilds them.
                digest = hashlib.sha256("\n".join(sources).encode()).hexdigest()[:12]
                _module = load_inline(
                    name=f"tokenmill_cpu_kernels_{digest}",
                    cpp_sources=sources,
                    functions=_FUNCTIONS,
                    # No fused multiply-adds where the source does not ask for
                    # them: float32 results then round as torch's separate ops do.
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
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
