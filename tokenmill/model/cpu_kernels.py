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

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_decode.cpp", "fused_ops.cpp", "skinny_gemm.cpp")]
_HEADERS = [_CSRC / "cpu_vec.h"]
_FUNCTIONS = ["paged_decode", "rms_norm", "fused_add_rms_norm", "rope_qkv_cache", "silu_and_mul",
              "skinny_gemm", "skinny_gemm_supported"]
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
                headers = [path.read_text() for path in _HEADERS]
                digest = hashlib.sha256("\n".join(sources + headers).encode()).hexdigest()[:12]
                _module = load_inline(
                    name=f"tokenmill_cpu_kernels_{digest}",
                    cpp_sources=sources,
                    functions=_FUNCTIONS,
                    # No fused multiply-adds where the source does not ask for
                    # them: float32 results then round as torch's separate ops do.
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
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


def skinny_gemm_ops(x: torch.Tensor, weight: torch.Tensor) -> Any | None:
    """The module with skinny_gemm when it applies to x @ weight.T (contiguous
    bf16 CPU tensors, K % 32 == 0, N % 16 == 0, AVX512-BF16), else None."""
    if x.device.type != "cpu" or weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return None
    if x.shape[-1] % 32 or weight.shape[0] % 16 or not x.is_contiguous():
        return None
    if not weight.is_contiguous():
        return None
    module = load()
    if module is None or not _skinny_supported(module):
        return None
    return module


_skinny_checked: bool | None = None


def _skinny_supported(module: Any) -> bool:
    """Whether the build has the AVX512-BF16 kernel (checked once on a tiny case)."""
    global _skinny_checked
    if _skinny_checked is None:
        probe = torch.zeros(1, 32, dtype=torch.bfloat16)
        _skinny_checked = bool(module.skinny_gemm_supported(probe, torch.zeros(16, 32, dtype=torch.bfloat16)))
    return _skinny_checked
