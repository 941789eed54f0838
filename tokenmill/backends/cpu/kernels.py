"""The C++ CPU kernels (csrc/): built once per machine with torch's
cpp_extension (g++ and ninja), loaded, and typed (`CpuOps`).

`make setup` builds them ahead of time; otherwise the first use builds them
(about a minute) into torch's extension cache. load() keeps the one compiled
module of the process (a cache of what the sources build, not configuration);
whether a runner uses it is `CpuBackendOptions.cpp_kernels` (options.py:
TOKENMILL_NO_CPP_KERNELS=1 runs the reference torch model only).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import torch

from tokenmill.backends.cpu.formats import CppPackedWeight, pack

logger = logging.getLogger("tokenmill")

_CSRC = Path(__file__).parent / "csrc"
# One translation unit, in this order: bindings.cpp (the PYBIND11_MODULE) last.
_SOURCES = [_CSRC / name for name in ("paged_attention.cpp", "fused_ops.cpp", "packed_gemm.cpp", "q8_gemm.cpp",
                                      "q4_gemm.cpp", "kq_gemm.cpp", "kq_pack.cpp", "parts_gemm.cpp", "moe.cpp", "cpu_features.cpp", "distributed.cpp",
                                      "layer_loop.cpp", "layer_stack.cpp", "lora_delta.cpp", "bindings.cpp")]
_HEADERS = [_CSRC / name for name in ("cpu_vec.h", "no_gil.h", "kv_prefetch.h", "layer_stack.h",
                                      "act_quant.h", "formats.h", "block_gemm.h", "kq_formats.h", "cpu_features.h",
                                      "distributed.h", "layer_loop.h", "moe.h", "team.h")]
# No fused multiply-adds where the source does not ask for them: float32
# results then round as torch's separate ops do. -fno-trapping-math (values
# unchanged: no reassociation, no contraction) lets GCC vectorise loops with a
# select in them on AVX2, where it keeps them scalar otherwise.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]


class CppLayerWeights(Protocol):
    """One decoder layer's weights for layer_loop / layer_stack (csrc/layer_stack.h).
    Norm weights are in the model's dtype, or float32 1 + w for Gemma's (plan.norm_weight)."""

    norm1: torch.Tensor
    qkv: CppPackedWeight
    o: CppPackedWeight
    norm2: torch.Tensor
    gate_up: CppPackedWeight  # [gate; up], no bias (a sparse MLP: none)
    down: CppPackedWeight
    num_experts: int  # a sparse MLP's (csrc/moe.h); 0: the dense MLP above
    q_norm: torch.Tensor  # per-head RMSNorm weight [head_dim] before RoPE (Qwen3, Gemma 3); empty: none
    k_norm: torch.Tensor
    sliding_window: int  # 0: none
    scale: float
    attn_out_norm: torch.Tensor  # Gemma's norm on the attention's output [hidden]; empty: none
    mlp_out_norm: torch.Tensor  # Gemma's norm on the MLP's output [hidden]; empty: none
    logit_softcap: float  # Gemma 2's attention soft-cap; 0: none


class CppModelWeights(Protocol):
    """The decoder stack's weights and shape (csrc/layer_stack.h), built once per plan."""

    layers: list[CppLayerWeights]
    final_norm: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    prefill_tiles: bool  # the attention kernel's opt-out of batch invariance


class CppLoraAdapterWeights(Protocol):
    """One LoRA adapter for layer_loop (csrc/layer_stack.h): per layer, per fused
    projection (model/lora.py's PROJECTIONS order), its A, each part's B and the
    scales, packed in the model's dtype; built once (plan.lora_weights)."""


class CppShmGroup(Protocol):
    """A tensor-parallel group's shared-memory all-reduce (csrc/distributed.h ShmGroup)."""

    rank: int
    size: int


class CpuOps(Protocol):
    """The compiled module's functions (csrc/*.cpp says what each computes).
    Tensors are CPU, float32 or bfloat16 unless named otherwise."""

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, sliding_window: int,
                        seq_ids: torch.Tensor, prefill_tiles: bool = False,
                        logit_softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> None: ...

    def rope_qkv_cache(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor, q_norm: torch.Tensor,
                       k_norm: torch.Tensor, eps: float) -> None: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def q8_embed(self, qweight: torch.Tensor, qscale: torch.Tensor, ids: torch.Tensor,
                 float32_out: bool) -> torch.Tensor: ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor: ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: torch.Tensor) -> None: ...

    def packed_gemm(self, x: torch.Tensor, weight: CppPackedWeight,
                    float32_out: bool) -> torch.Tensor: ...  # (in weight's format: csrc/formats.h)

    def packed_gemm_silu(self, x: torch.Tensor, weight: CppPackedWeight) -> torch.Tensor: ...

    def packed_gemm_dtypes(self) -> list[str]: ...

    def weight_formats(self) -> list[str]: ...

    def kq_pack(self, fmt: str, blocks: torch.Tensor, out: torch.Tensor) -> None: ...

    def q8_pack(self, q: torch.Tensor, d: torch.Tensor, out: torch.Tensor) -> None: ...

    def PackedWeight(self, *, format: int, n: int, k: int, data: torch.Tensor,
                     bias: torch.Tensor, parts: list[CppPackedWeight] = ...) -> CppPackedWeight: ...

    # (the MLP: gate_up and down, or a sparse MLP's router and experts, csrc/moe.h)
    def LayerWeights(self, *, norm1: torch.Tensor, qkv: CppPackedWeight, o: CppPackedWeight,
                     norm2: torch.Tensor, gate_up: CppPackedWeight | None = None,
                     down: CppPackedWeight | None = None, q_norm: torch.Tensor, k_norm: torch.Tensor,
                     sliding_window: int, scale: float, attn_out_norm: torch.Tensor, mlp_out_norm: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, logit_softcap: float,
                     router: CppPackedWeight | None = None, experts_gate_up: list[CppPackedWeight] = ...,
                     experts_down: list[CppPackedWeight] = ..., top_k: int = 0,
                     norm_topk_prob: bool = False, topk_then_softmax: bool = False, swiglu_limit: float = 0.0,
                     swiglu_alpha: float = 1.702, sinks: torch.Tensor | None = None) -> CppLayerWeights: ...

    def moe_mlp(self, x: torch.Tensor, router: CppPackedWeight, experts_gate_up: list[CppPackedWeight],
                experts_down: list[CppPackedWeight], top_k: int, norm_topk_prob: bool,
                topk_then_softmax: bool = False, swiglu_limit: float = 0.0,
                swiglu_alpha: float = 1.702) -> torch.Tensor: ...

    def ModelWeights(self, *, layers: list[CppLayerWeights], final_norm: torch.Tensor, eps: float,
                     num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                     sin: torch.Tensor, prefill_tiles: bool, act: str) -> CppModelWeights: ...

    def layer_loop(self, model: CppModelWeights, hidden: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, tables: torch.Tensor,
                   seq_lens: torch.Tensor, seq_ids: torch.Tensor, layer_groups: list[int], output_rows: torch.Tensor,
                   all_rows: bool, kv_prefetch: int, lora_adapters: list[CppLoraAdapterWeights] = ...,
                   lora_rows: list[torch.Tensor] = ...) -> torch.Tensor: ...

    def LoraAdapterWeights(self, *, a: list[torch.Tensor], b: list[torch.Tensor], scale: list[torch.Tensor],
                           parts: list[torch.Tensor], dtype: torch.dtype) -> CppLoraAdapterWeights: ...

    def lora_delta(self, out: torch.Tensor, x: torch.Tensor, lora_adapters: list[CppLoraAdapterWeights],
                   lora_rows: list[torch.Tensor], layer: int, projection: int) -> None: ...

    def ShmGroup(self, *, region: torch.Tensor, rank: int, size: int, capacity: int, pids: list[int],
                 timeout_s: float) -> CppShmGroup: ...

    def layer_loop_tp(self, model: CppModelWeights, hidden: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, tables: torch.Tensor,
                      seq_lens: torch.Tensor, seq_ids: torch.Tensor, layer_groups: list[int],
                      output_rows: torch.Tensor, all_rows: bool, group: CppShmGroup,
                      kv_prefetch: int) -> torch.Tensor: ...

    def shm_all_reduce(self, group: CppShmGroup, t: torch.Tensor) -> None: ...

    def shm_gather(self, group: CppShmGroup, local: torch.Tensor, out: torch.Tensor,
                   widths: list[int]) -> None: ...

    def shm_send(self, group: CppShmGroup, data: torch.Tensor) -> None: ...

    def shm_receive(self, group: CppShmGroup) -> torch.Tensor: ...

    def layer_stack(self, model: CppModelWeights, hidden: torch.Tensor, positions: torch.Tensor,
                    kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, tables: torch.Tensor,
                    seq_lens: torch.Tensor, seq_ids: torch.Tensor, layer_groups: list[int],
                    bounds: list[int], kv_prefetch: int, lora_adapters: list[CppLoraAdapterWeights] = ...,
                    lora_rows: list[torch.Tensor] = ...) -> torch.Tensor: ...

    def kv_prefetch_rows(self, kv_cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                         seq_ids: torch.Tensor, window: int) -> torch.Tensor: ...


# The process's one compiled extension (built once, by the first load()), the
# reason it could not be built, and the dtypes its packed GEMM serves.
_lock = threading.Lock()
_module: CpuOps | None = None
_failed: str | None = None
_packed_dtypes: frozenset[str] = frozenset()


def disabled_reason(cpp_kernels: bool = True) -> str | None:
    """Why the kernels do not serve (`cpp_kernels`: CpuBackendOptions'), or None where they do."""
    if not cpp_kernels:
        return "the C++ kernels are switched off (TOKENMILL_NO_CPP_KERNELS)"
    if load() is None:
        return f"the C++ kernels could not be built ({(_failed or '')[:200]})"
    return None


def load() -> CpuOps | None:
    """The compiled module, or None where it cannot be built (the reason is
    logged once)."""
    global _module, _failed, _packed_dtypes
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                module = _build()
                _packed_dtypes = frozenset(module.packed_gemm_dtypes())
                _module = module
            except Exception as e:  # no compiler, no ninja, ...: the reference model serves
                _failed = f"{type(e).__name__}: {e}"
                logger.warning("C++ CPU kernels unavailable, using torch code: %s", _failed[:300])
    return _module


def _build() -> CpuOps:
    from torch.utils.cpp_extension import load_inline

    # torch finds ninja on PATH; the `ninja` wheel puts it next to this Python.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    sources = [path.read_text() for path in _SOURCES]
    # The name carries a hash of the sources and flags, so an edit rebuilds them.
    headers = [path.read_text() for path in _HEADERS]
    digest = hashlib.sha256("\n".join(sources + headers + _CFLAGS).encode()).hexdigest()[:12]
    module = load_inline(
        name=f"tokenmill_cpu_kernels_{digest}",
        cpp_sources=sources,
        extra_cflags=_CFLAGS,
        extra_include_paths=[str(_CSRC)],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    return cast("CpuOps", module)


def paged_attention_kernel() -> Callable[..., torch.Tensor] | None:
    module = load()
    return None if module is None else module.paged_attention


def fused_ops(x: torch.Tensor) -> CpuOps | None:
    """The module when its fused ops (csrc/fused_ops.cpp) apply to `x` (a
    contiguous float32 or bfloat16 CPU tensor), else None: the caller runs torch code."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not x.is_contiguous():
        return None
    return load()


def packed_gemm_ops(x: torch.Tensor) -> CpuOps | None:
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
    return module if str(x.dtype).removeprefix("torch.") in _packed_dtypes else None




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
                packed = pack(ops, str(dtype).removeprefix("torch."), w)
                kernel = functools.partial(ops.packed_gemm, x, packed, False)
                best = min(best, fastest(kernel))
            total_s += best
            total_flop += 2.0 * rows * k * n
    return total_flop / total_s / 1e9
