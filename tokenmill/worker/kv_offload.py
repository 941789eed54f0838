"""The runner's half of the disk tier (kv_offload_dir): a block's K/V, all
layers, to bytes and back (the files themselves: core/kv_disk.py), and the
fingerprint that keeps one engine's blocks from another's.

A block's payload is its K and V in every layer, `[layers, 2, block_size,
num_kv_heads, head_dim]` in the cache's dtype, the bytes as they sit in the
cache: a loaded block is the same bits the engine computed, so a request on
loaded blocks gives the tokens it gives on blocks it computed (as a RAM
prefix-cache hit does).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence

import torch

from tokenmill.config import ModelSpec
from tokenmill.core.contracts import KVBlockTransfer, KVTransferStats
from tokenmill.core.kv_disk import BlockFiles
from tokenmill.model.kv_format import kv_cache_format

# Bump when the payload's layout or anything the fingerprint reads changes.
FORMAT_VERSION = 1
# The weights' bytes the fingerprint reads: this many pieces of each file, evenly spread.
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10


def fingerprint(model_path: str, spec: ModelSpec, dtype: torch.dtype, block_size: int,
                quantization: str | None, forward: str, kv_cache_dtype: str = "auto") -> str:
    """32 hex digits naming what a block's K/V depend on besides its tokens: the
    model (its config and a sample of its weights' bytes: two checkpoints of one
    architecture differ there; a model rewritten in place too), the cache's dtype
    and shape and `kv_cache_dtype` (the KV format), the block size, the weights' quantization, the
    forward that computes K/V (`forward`: its kind and the switches that change
    its arithmetic), and Python's tuple hash (the chain hashes are made with it)."""
    h = hashlib.sha256()
    h.update(json.dumps({
        "format": FORMAT_VERSION, "dtype": str(dtype), "block_size": block_size,
        "kv_cache_dtype": kv_cache_format(kv_cache_dtype).name,
        "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "quantization": quantization, "forward": forward,
        "python": list(sys.version_info[:2]), "hash_bits": sys.hash_info.width,
    }, sort_keys=True).encode())
    for path in _model_files(model_path):
        h.update(os.path.basename(path).encode())
        h.update(_file_sample(path))
    return h.hexdigest()[:32]


def _model_files(model_path: str) -> list[str]:
    if os.path.isfile(model_path):
        return [model_path]
    names = sorted(n for n in os.listdir(model_path)
                   if n == "config.json" or n.endswith((".safetensors", ".gguf", ".bin")))
    return [os.path.join(model_path, n) for n in names]


def _file_sample(path: str) -> bytes:
    """A file's size and _SAMPLES pieces of it (all of it when small), hashed."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _SAMPLES * _SAMPLE_BYTES:
            h.update(f.read())
        else:
            step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(i * step)
                h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


class KVOffloader:
    """Copies blocks between the runner's KV cache and the block files."""

    def __init__(self, kv_caches: list[torch.Tensor], files: BlockFiles) -> None:
        # As bytes: a payload is the blocks' bytes in any format (model/kv_format.py).
        self.kv_caches = [cache.view(torch.uint8) for cache in kv_caches]
        self.files = files
        _, _, block_size, kv_heads, entry_bytes = self.kv_caches[0].shape
        self.block_shape = (len(kv_caches), 2, block_size, kv_heads, entry_bytes)
        self.payload_bytes = len(kv_caches) * 2 * block_size * kv_heads * entry_bytes

    def load(self, loads: Sequence[KVBlockTransfer], stats: KVTransferStats) -> list[int]:
        """Read `loads` into their blocks (before the forward); the ids of those
        that loaded (a bad or missing file is left out: a miss)."""
        start = time.perf_counter()
        loaded = []
        for t in loads:
            payload = self.files.read(t.block_hash, t.parent_hash, t.token_ids, self.payload_bytes)
            if payload is None:
                stats.num_failed_loads += 1
                continue
            block = torch.frombuffer(payload, dtype=torch.uint8).view(self.block_shape)
            for layer, cache in enumerate(self.kv_caches):
                cache[:, t.block_id].copy_(block[layer])
            loaded.append(t.block_id)
            stats.num_loaded_blocks += 1
            stats.bytes_loaded += len(payload)
        stats.load_s += time.perf_counter() - start
        return loaded

    def store(self, stores: Sequence[KVBlockTransfer], stats: KVTransferStats) -> None:
        """Write `stores` (blocks the forward just filled) unless their files are
        there, then keep the directory's bound."""
        start = time.perf_counter()
        for t in stores:
            block = torch.stack([cache[:, t.block_id] for cache in self.kv_caches]).cpu()
            written = self.files.write(t.block_hash, t.parent_hash, t.token_ids,
                                       block.reshape(-1).numpy().data)
            stats.num_stored_blocks += written > 0
            stats.bytes_stored += written
        scan = self.files.after_writes()
        stats.num_files_removed += scan.num_removed if scan is not None else 0
        stats.store_s += time.perf_counter() - start
