"""The KV cache's stored formats (`--kv-cache-dtype`, vLLM's names plus llama.cpp's
q8_0), and the reference that writes and reads them; the C++ side
(backends/cpu/csrc/kv_format.h) writes the same bits.

A layer's cache is [2, num_blocks, block_size, num_kv_heads, entry]:

    auto      the model's dtype, entry = head_dim values
    q8_0      uint8, entry = head_dim / 32 blocks of 34 bytes, llama.cpp's block_q8_0:
              a float16 scale d, then 32 int8 q; x = d * q, d = max|x| / 127
              (q rounded ties-to-even). 34 / 64 = 0.53x of bfloat16's bytes.
    fp8_e4m3  float8_e4m3fn, entry = head_dim (vLLM's fp8 with scale 1.0),
              saturated at +-448; 0.5x of bfloat16's bytes
    fp8_e5m2  float8_e5m2, the same, saturated at +-57344
    (fp8 is fp8_e4m3, as in vLLM)

The format is the cache tensor's dtype: whoever holds the tensor knows how it
is stored (`format_of`). Readers compute on the decoded values in float32
(the C++ kernels' arithmetic); "auto" keeps the model's dtype and its path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import KV_CACHE_DTYPES

Q8_VALUES, Q8_BYTES = 32, 34
# The float8 storages: held and moved as uint8 (indexing, copies and fills on
# float8 tensors are not supported everywhere).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KVCacheFormat:
    name: str  # "auto" (the model's dtype), "q8_0", "fp8_e4m3", "fp8_e5m2"
    storage: torch.dtype | None  # None: the model's dtype

    @property
    def quantized(self) -> bool:
        return self.storage is not None

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.storage if self.storage is not None else model_dtype

    def entry(self, head_dim: int) -> int:
        """The cache's last dimension for one head."""
        return head_dim // Q8_VALUES * Q8_BYTES if self.name == "q8_0" else head_dim

    def entry_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=self.storage_dtype(model_dtype)).element_size()
        return self.entry(head_dim) * element

    def check(self, head_dim: int) -> None:
        if self.name == "q8_0" and head_dim % Q8_VALUES:
            raise ValueError(f"kv_cache_dtype='q8_0' stores blocks of {Q8_VALUES} values, and this "
                             f"model's head_dim is {head_dim}; use 'fp8' or 'auto'")

    def shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, self.entry(head_dim))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] (any float dtype) -> its entries [..., entry], stored dtype."""
        if self.name == "q8_0":
            lead, head_dim = x.shape[:-1], x.shape[-1]
            v = x.float().reshape(*lead, head_dim // Q8_VALUES, Q8_VALUES)
            d = v.abs().amax(-1, keepdim=True) / 127
            inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
            q = torch.round(v * inv).to(torch.int8).view(torch.uint8)
            scale = d.to(torch.float16).view(torch.uint8)  # [..., nb, 2], little-endian
            return torch.cat([scale, q], dim=-1).reshape(*lead, head_dim // Q8_VALUES * Q8_BYTES)
        if self.storage is not None:  # fp8: saturate, then round to nearest
            limit = torch.finfo(self.storage).max
            return x.float().clamp(-limit, limit).to(self.storage)
        return x

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Entries [..., entry] -> values [..., head_dim]: float32 for a quantized
        format (what the kernels compute on), else `dtype`."""
        if self.name == "q8_0":
            lead = stored.shape[:-1]
            blocks = stored.reshape(*lead, -1, Q8_BYTES)
            d = blocks[..., :2].contiguous().view(torch.float16).float()
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (d * q).reshape(*lead, -1)
        if self.storage is not None:
            return stored.float()
        return stored.to(dtype)


_FORMATS = {
    "auto": KVCacheFormat("auto", None),
    "q8_0": KVCacheFormat("q8_0", torch.uint8),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", torch.float8_e5m2),
}
_BY_STORAGE = {f.storage: f for f in _FORMATS.values() if f.storage is not None}


def kv_cache_format(name: str) -> KVCacheFormat:
    """The format `--kv-cache-dtype name` stores (ValueError naming the choices)."""
    key = "fp8_e4m3" if name == "fp8" else name
    if key not in _FORMATS:
        raise ValueError(f"kv_cache_dtype={name!r} is not supported; use one of {KV_CACHE_DTYPES}")
    return _FORMATS[key]


def format_of(kv_cache: torch.Tensor) -> KVCacheFormat:
    """The format a cache tensor stores, by its dtype."""
    return _BY_STORAGE.get(kv_cache.dtype, _FORMATS["auto"])


def bytes_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (FP8_DTYPES); any other cache as it is."""
    return kv_cache.view(torch.uint8) if kv_cache.dtype in FP8_DTYPES else kv_cache


def gather(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """kv_cache[:, blocks] in the cache's own dtype (for `values`)."""
    picked = bytes_view(kv_cache)[:, blocks]
    return picked.view(kv_cache.dtype) if picked.dtype != kv_cache.dtype else picked


def values(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries [..., entry] -> values [..., head_dim]: float32 from an 8-bit
    format (the kernels' arithmetic), else `dtype`."""
    return format_of(stored).decode(stored, dtype)


def write_entries(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store x [n, num_kv_heads, head_dim] at `slots` of flat_cache [num_slots,
    num_kv_heads, entry], in its format."""
    fmt = format_of(flat_cache)
    encoded = fmt.encode(x.to(flat_cache.dtype) if fmt.storage is None else x)
    bytes_view(flat_cache).index_copy_(0, slots, bytes_view(encoded))
