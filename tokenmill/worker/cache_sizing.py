"""How many KV blocks fit in the memory budget."""

from __future__ import annotations

import torch

from tokenmill.config import CacheConfig, ModelSpec
from tokenmill.core.kv_layout import KVLayout
from tokenmill.model.kv_format import kv_cache_format

# vLLM's CPU backend defaults to 4 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE); so do we,
# unless free memory is scarcer.
DEFAULT_CPU_KV_BYTES = 4 << 30
CPU_FREE_MEMORY_SHARE = 0.3
CUDA_FREE_MEMORY_SHARE = 0.5


def available_cpu_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_kv_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_MEMORY_SHARE)
    available = available_cpu_memory_bytes()
    if available is None:  # unknown: assume the default fits
        return DEFAULT_CPU_KV_BYTES
    return min(DEFAULT_CPU_KV_BYTES, int(available * CPU_FREE_MEMORY_SHARE))


def bytes_per_block(spec: ModelSpec, dtype: torch.dtype, block_size: int, layout: KVLayout | None = None,
                    cache_dtype: str = "auto") -> int:
    """A block's bytes: block_size tokens of K/V in every layer, or in each slot of
    `layout` (core/kv_layout.py: a block holds one layer group), stored as
    `cache_dtype` says (model/kv_format.py)."""
    entry = kv_cache_format(cache_dtype).entry_bytes(spec.head_dim, dtype)
    layers = spec.num_layers if layout is None else layout.slots
    return 2 * spec.num_kv_heads * entry * layers * block_size


def num_kv_blocks(
    spec: ModelSpec, dtype: torch.dtype, cache_config: CacheConfig, device: torch.device,
    layout: KVLayout | None = None,
) -> int:
    per_block = bytes_per_block(spec, dtype, cache_config.block_size, layout, cache_config.cache_dtype)
    if cache_config.num_blocks_override is not None:
        # Counted in blocks of every layer (memory): a layout's blocks hold a group each.
        slots = spec.num_layers if layout is None else layout.slots
        num_blocks = cache_config.num_blocks_override * spec.num_layers // slots
    else:
        budget = cache_config.kv_cache_memory_bytes or default_kv_cache_bytes(device)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no KV block; one block of "
                f"{cache_config.block_size} tokens needs {per_block} bytes for this model"
            )
    # On the CPU every page of the cache is faulted in at start (worker/model_runner.zeros):
    # a cache larger than the free memory would meet the OOM killer there, not this message.
    available = available_cpu_memory_bytes() if device.type == "cpu" else None
    if available is not None and num_blocks * per_block > available:
        raise ValueError(
            f"a KV cache of {num_blocks} blocks ({num_blocks * per_block / 2**30:.1f} GiB) is more "
            f"than this machine's {available / 2**30:.1f} GiB of available memory; lower "
            "kv_cache_memory_bytes (or num_kv_blocks)"
        )
    return int(num_blocks)
