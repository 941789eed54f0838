"""Every environment variable tokenmill reads, each with what it does.

Each is read when its function is called, never at import, so a test or a
parent process that sets one before the call is seen. Imports nothing from
tokenmill: every module may import it. Variables tokenmill sets for its child
processes (OMP_NUM_THREADS, ...) are not here: they are not reads. OpenMP's
own OMP_WAIT_POLICY / GOMP_SPINCOUNT are libgomp's, read by libgomp; the
entry points only respect a user's choice of them (engine/openmp_wait.py),
and the extension's build puts the venv's bin/ on PATH for ninja
(backends/cpu/kernels.py).
"""

from __future__ import annotations

import os


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value != "0"


def no_cpp_kernels() -> bool:
    """TOKENMILL_NO_CPP_KERNELS=1: run the reference torch model only, never the
    C++ CPU kernels (read when the CPU backend's options are built)."""
    return _flag("TOKENMILL_NO_CPP_KERNELS", False)


def tp_layer_loop() -> bool:
    """TOKENMILL_TP_LAYER_LOOP=0: a tensor-parallel shard runs the Python layer
    loop even where its group all-reduces over shared memory (the A/B of
    benchmarks/tp_step.py); default 1, the C++ loop."""
    return _flag("TOKENMILL_TP_LAYER_LOOP", True)


def kv_prefetch() -> str:
    """TOKENMILL_KV_PREFETCH=auto|off|on: whether the C++ layer calls ask for the
    next layer's K/V during the projections (backends/cpu/options.py
    CpuBackendOptions.kv_prefetch); default auto, where it was measured to pay."""
    return os.environ.get("TOKENMILL_KV_PREFETCH") or "auto"


def batch_invariant() -> bool:
    """TOKENMILL_BATCH_INVARIANT=0: give up batch invariance for speed where it
    costs (backends/cpu/options.py CpuBackendOptions.batch_invariant); default 1,
    a request's greedy tokens do not depend on what else the server runs."""
    return _flag("TOKENMILL_BATCH_INVARIANT", True)


def allow_runtime_lora_updating() -> bool:
    """TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=1: the server adds POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING); default off, the adapters are those of
    --lora-modules."""
    return _flag("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", False)


def tp_shm() -> bool:
    """TOKENMILL_TP_SHM=0 (on any rank): tensor parallelism over gloo even where
    every rank shares the machine (set but empty: gloo too); default 1, shared
    memory where it can."""
    return os.environ.get("TOKENMILL_TP_SHM", "1") not in ("0", "")


def tp_timeout_s() -> float:
    """TOKENMILL_TP_TIMEOUT_S: seconds a collective of a step may wait for the
    other ranks before the group stops (default 120)."""
    return float(os.environ.get("TOKENMILL_TP_TIMEOUT_S", "120"))


def tp_init_timeout_s() -> float:
    """TOKENMILL_TP_INIT_TIMEOUT_S: seconds the ranks may take to start and meet
    (loading the model included; default 600)."""
    return float(os.environ.get("TOKENMILL_TP_INIT_TIMEOUT_S", "600"))


def vllm_preload() -> bool:
    """TOKENMILL_VLLM_PRELOAD=0: run the vLLM-CPU peer of the benchmarks without
    Intel OpenMP / tcmalloc preloaded (default 1, as vLLM's CPU guide advises)."""
    return _flag("TOKENMILL_VLLM_PRELOAD", True)


LLAMA_SERVER = "TOKENMILL_LLAMA_SERVER"
LLAMA_CPP = "TOKENMILL_LLAMA_CPP"


def llama_cpp() -> str | None:
    """TOKENMILL_LLAMA_CPP: the llama.cpp build directory `bench sizes` uses
    (its converter, llama-quantize, llama-bench) where no flag names one."""
    return os.environ.get(LLAMA_CPP) or None


def llama_server() -> str | None:
    """TOKENMILL_LLAMA_SERVER: the llama-server binary the benchmarks run where
    no --llama-server flag names one (else llama-server on PATH)."""
    return os.environ.get(LLAMA_SERVER) or None
