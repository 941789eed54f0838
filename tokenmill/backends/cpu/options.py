"""The CPU backend's options: what a process chose, built once where the
engine is configured (engine/arg_utils.py EngineArgs.create_cpu_options, from
the environment) and passed down to the plan; never read again."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill import envs

# kv_prefetch's modes, each as the C++ layer calls take it (csrc/cpu_features.h KvPrefetchMode).
KV_PREFETCH_MODES = {"auto": -1, "off": 0, "on": 1}


@dataclass(frozen=True)
class CpuBackendOptions:
    cpp_kernels: bool = True  # False: the reference torch model only (TOKENMILL_NO_CPP_KERNELS=1)
    # A tensor-parallel shard may run its layers in one C++ call over shared
    # memory (dispatch.Path.TP_LOOP); False: the Python loop (TOKENMILL_TP_LAYER_LOOP=0,
    # the A/B of benchmarks/tp_step.py).
    tp_layer_loop: bool = True
    # Whether the C++ layer calls ask for the next layer's K/V during the
    # projections (csrc/kv_prefetch.h): "auto" where it was measured to pay
    # (csrc/cpu_features.cpp kv_prefetch_pays), "off", or "on" wherever it
    # applies, on any CPU (tests, A/B runs). TOKENMILL_KV_PREFETCH.
    kv_prefetch: str = "auto"
    # Batch invariance: every row of a step gives the bits it gives alone, in any
    # step, chunk or recompute (a request's greedy tokens do not move with the
    # load). Where that costs, False buys the speed back (TOKENMILL_BATCH_INVARIANT=0):
    # the reference model's bf16 linears in one call instead of fixed 8-row
    # blocks (model/llama.py linear) and its prefills through SDPA instead of
    # the decode's computation (model/attention.py); on AVX512-BF16 CPUs the
    # attention kernel's prefill tiles (csrc/paged_attention.cpp).
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.kv_prefetch not in KV_PREFETCH_MODES:
            raise ValueError(f"kv_prefetch must be one of {', '.join(KV_PREFETCH_MODES)}, not "
                             f"{self.kv_prefetch!r} (TOKENMILL_KV_PREFETCH)")

    @classmethod
    def from_env(cls) -> CpuBackendOptions:
        return cls(cpp_kernels=not envs.no_cpp_kernels(), tp_layer_loop=envs.tp_layer_loop(),
                   kv_prefetch=envs.kv_prefetch(), batch_invariant=envs.batch_invariant())
