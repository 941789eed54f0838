"""GGUF tensors as torch weights: dequantized to float32, and llama.cpp's q/k row
order undone; shared by the model loader and the LoRA adapter reader (a module
of its own, so that model/lora.py need not import the loader, which imports the
models that import it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: missing, unexpected or misshapen tensors."""


def dequantize_gguf_tensor(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as float32, in PyTorch's [out_features, in_features] layout."""
    from gguf.quants import dequantize

    try:
        array = dequantize(_longer_rows(tensor.data), tensor.tensor_type)
    except NotImplementedError as e:
        raise WeightLoadError(
            f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf "
            "package cannot dequantize; use a file with another quantization"
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # a view of the memory-mapped file
        array = array.copy()
    return torch.from_numpy(array)


def _longer_rows(data: np.ndarray, group_bytes: int = 1 << 22) -> np.ndarray:
    """Quantized rows regrouped k at a time into longer ones (up to ~group_bytes
    for the 16 rows gguf.quants dequantizes a call). Its calls on rows of a few
    hundred values are mostly overhead; the blocks are independent and stored
    in order, so longer rows give the same values in the same order, about
    twice as fast for the default model (docs/perf-notes.md, start-up)."""
    if data.dtype != np.uint8 or data.ndim == 0:
        return data  # float types are views, not blocks
    rows = data.reshape(-1, data.shape[-1])
    n, row_bytes = rows.shape
    cap = min(n, max(1, group_bytes // (16 * row_bytes)))
    k = max(d for d in range(1, cap + 1) if n % d == 0)
    return rows.reshape(n // k, k * row_bytes)


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation. Per head, HF orders the rotary pairs
    as two halves [x0..x(d/2-1) | x(d/2)..x(d-1)]; llama.cpp interleaves them
    [x0 x(d/2) x1 x(d/2+1) ...]. Works for weights [rows, in] and biases [rows]."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(weight.shape)
    )
