"""The CPU backend's options: what a process chose, built once (from the
environment or by the caller) and passed to the plan; never read again."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill import envs


@dataclass(frozen=True)
class CpuBackendOptions:
    cpp_kernels: bool = True  # False: the reference torch model only (TOKENMILL_NO_CPP_KERNELS=1)
    # A tensor-parallel shard may run its layers in one C++ call over shared
    # memory (dispatch.Path.TP_LOOP); False: the Python loop (TOKENMILL_TP_LAYER_LOOP=0,
    # the A/B of benchmarks/tp_step.py).
    tp_layer_loop: bool = True

    @classmethod
    def from_env(cls) -> CpuBackendOptions:
        return cls(cpp_kernels=not envs.no_cpp_kernels(), tp_layer_loop=envs.tp_layer_loop())
