"""Rotary position embedding (RoPE), Hugging Face's rotate_half convention.

Each head vector is split in two halves (x1, x2), not interleaved pairs:

    rotate_half(x) = [-x2, x1]
    x' = x * cos(pos * inv_freq) + rotate_half(x) * sin(pos * inv_freq)

cos/sin are computed once in float32 for every position up to `max_positions`
and indexed by each token's position, so a ragged batch needs no padding.
The frequencies follow `transformers.modeling_rope_utils` exactly.

Two Phi-3 features are rows and columns of those tables:
- LongRoPE (rope_type "longrope"): a position below original_max_position_embeddings
  rotates with short_factor's frequencies, one at or past it with long_factor's,
  and every cos/sin is times the attention factor (HF's `attention_scaling`).
  transformers picks one set for the whole sequence by its current length (it
  recomputes the cache when the length passes the original maximum), so the two
  agree exactly while a sequence stays within it; past it, transformers rotates
  every position with the long set, this table only those at or past it.
- Partial rotary (rotary_dim < head_dim): the rotated pairs are the first
  rotary_dim / 2 columns and the rest turn by angle 0 (cos 1, sin 0: x * 1 +
  y * 0 is x exactly), which is HF's pass-through once the loader has ordered
  each head's q/k rows so that its pass-through pairs also sit head_dim / 2 apart
  (model/fused_checkpoint.rotary_row_order). The C++ plan reads these tables as they are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies, [head_dim // 2] float32, as transformers computes them."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_scaling is None or rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "freq_factors":
        # llama.cpp's per-frequency divisors (a GGUF `rope_freqs` tensor).
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float)
        return inv_freq / factors
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling)
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    # Same order of operations as transformers, for bit-identical frequencies.
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor
    smoothed_inv_freq = smoothed_inv_freq + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq(dim: int, rope_theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    # YaRN (gpt-oss): frequencies that turn fewer than beta_slow times within the
    # original context are interpolated (divided by factor), those turning more
    # than beta_fast times kept, a linear ramp between; transformers' order of operations.
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope_theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_attention_factor(scaling: Mapping[str, Any]) -> float:
    """The factor on YaRN's cos and sin: its `attention_factor`, else 0.1 ln(factor) + 1
    (or the mscale ratio where both mscale and mscale_all_dim are given), as transformers."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]))
    return mscale()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim] in x's dtype."""
    return (x * cos) + (rotate_half(x) * sin)


def _longrope_inv_freq(dim: int, rope_theta: float, factors: Any) -> torch.Tensor:
    # transformers' _compute_longrope_parameters, in its order of operations.
    ext = torch.tensor(list(factors), dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * rope_theta**shape)


def rope_angles(positions: torch.Tensor, dim: int, rope_theta: float,
                rope_scaling: Mapping[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(angles [len(positions), dim // 2] float32, the factor on cos and sin) of
    the rotated `dim` columns of a head."""
    scaling = rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        inv_freq = compute_inv_freq(dim, rope_theta, rope_scaling).to(positions.device)
        factor = yarn_attention_factor(scaling) if scaling.get("rope_type") == "yarn" else 1.0
        return positions[:, None] * inv_freq[None, :], factor
    short = _longrope_inv_freq(dim, rope_theta, scaling["short_factor"]).to(positions.device)
    long = _longrope_inv_freq(dim, rope_theta, scaling["long_factor"]).to(positions.device)
    within = (positions < scaling["original_max_position_embeddings"])[:, None]
    inv_freq = torch.where(within, short[None, :], long[None, :])
    return positions[:, None] * inv_freq, float(scaling["attention_factor"])


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: Mapping[str, Any] | None,
        max_positions: int,
        device: torch.device | str | None = None,
        rotary_dim: int | None = None,  # the rotated columns (None: all of head_dim)
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        if torch.device(device or "cpu").type == "meta":
            # Shapes only (a shard's skeleton, model/parallel.py): arange on the meta
            # device runs torch's Python decompositions, which import torch._dynamo
            # and with it triton (on a CPU run, ~30 nanobind "leaked" lines at exit).
            empty = torch.empty(max_positions, head_dim // 2, device="meta")
            self.register_buffer("cos_cache", empty, persistent=False)
            self.register_buffer("sin_cache", empty.clone(), persistent=False)
            return
        rotary = rotary_dim or head_dim
        # One half of the angles is enough: HF's cat((freqs, freqs)) repeats them.
        positions = torch.arange(max_positions, dtype=torch.float, device=device)
        freqs, scale = rope_angles(positions, rotary, rope_theta, rope_scaling)  # [max_positions, rotary // 2]
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:  # LongRoPE, YaRN: HF scales its float32 cos/sin before the cast
            cos, sin = cos * scale, sin * scale
        if rotary < head_dim:  # the pass-through pairs: angle 0, unscaled
            pad = (max_positions, (head_dim - rotary) // 2)
            cos = torch.cat([cos, torch.ones(pad, device=device)], dim=1)
            sin = torch.cat([sin, torch.zeros(pad, device=device)], dim=1)
        # Buffers, not parameters: they are not in checkpoints (persistent=False).
        self.register_buffer("cos_cache", cos.contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin.contiguous(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64 -> cos, sin: [num_tokens, 1, head_dim] in `dtype`."""
        # Cast after computing in float32, as HF does.
        cos = self.cos_cache[positions].to(dtype)  # [num_tokens, head_dim // 2]
        sin = self.sin_cache[positions].to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q: [num_tokens, num_heads, head_dim] and k: [num_tokens, num_kv_heads,
        head_dim] for ragged `positions`: [num_tokens]. (The model itself computes cos/sin
        once per step with `cos_sin` and calls `apply_rotary_emb` in every layer.)"""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
