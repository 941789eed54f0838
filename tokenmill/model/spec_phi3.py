"""Phi-3 and Phi-4 (`Phi3ForCausalLM`, GGUF `phi3`): their ModelSpec fields from a
config.json or from a GGUF file's metadata.

A Phi-3 layer is the Llama layer: its fused qkv_proj and gate_up_proj are split
at load (model/fused_checkpoint.py). What it adds is in RoPE and the window:
- partial rotary (Phi-4-mini: partial_rotary_factor 0.75): `rotary_dim`;
- LongRoPE (rope_scaling type "longrope", or its old names "su" and "yarn", as
  transformers' Phi3Config reads them): short_factor / long_factor, the original
  context length (config.json's top-level original_max_position_embeddings, 4096
  when absent, which transformers prefers to rope_scaling's), and the factor on
  cos/sin (`attention_factor`, else transformers' sqrt(1 + ln(s) / ln(original))
  with s = `factor`, else max_position_embeddings / original). model/rope.py says
  which set a position takes;
- `sliding_window` on every layer, as transformers masks it (llama.cpp's phi3
  graph currently ignores it; tokenmill follows transformers).
A GGUF file is read as llama.cpp's converter writes it: `phi3.rope.dimension_count`,
the tensors rope_factors_short / rope_factors_long, `phi3.rope.scaling.
original_context_length` and `.attn_factor`, `phi3.attention.sliding_window` (0: none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.model.spec_checks import positive_float, positive_int

if TYPE_CHECKING:
    from tokenmill.model.gguf_file import GGUFFile

PHI3_ARCHITECTURES = ("Phi3ForCausalLM",)
# transformers' Phi3Config reads the old names as "longrope".
_LONGROPE_NAMES = ("longrope", "su", "yarn")
_DEFAULT_ORIGINAL_MAX = 4096  # Phi3Config's original_max_position_embeddings


def phi3_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`cfg` with Phi3Config's defaults where they are not the generic reader's."""
    return {"rms_norm_eps": 1e-5, **cfg}


def phi3_hf_fields(cfg: Mapping[str, Any], head_dim: int, max_position_embeddings: int,
                   path: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, rotary_dim and sliding_window of a Phi-3 config.json."""
    for field in ("rope_scaling", "rope_parameters"):
        value = cfg.get(field)
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{path}: {field}={value!r} is invalid; it must be an object or null")
    # Phi3Config takes rope_scaling over rope_parameters where a file has both.
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope_theta = positive_float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", path)
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise ValueError(f"{path}: partial_rotary_factor={factor!r} is invalid; it must be in (0, 1]")
    rotary = int(head_dim * factor)  # (transformers' rounding)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"{path}: partial_rotary_factor={factor!r} rotates {rotary} of the head's "
                         f"{head_dim} dimensions; RoPE needs an even number >= 2")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        scaling = None
    elif rope_type in _LONGROPE_NAMES:
        original = positive_int(cfg.get("original_max_position_embeddings", _DEFAULT_ORIGINAL_MAX),
                                "original_max_position_embeddings", path)
        scale = params.get("factor")
        scale = max_position_embeddings / original if scale is None else positive_float(
            scale, "rope_scaling.factor", path)
        attention = params.get("attention_factor")
        scaling = longrope_scaling(
            _factors(params.get("short_factor"), rotary, "rope_scaling.short_factor", path),
            _factors(params.get("long_factor"), rotary, "rope_scaling.long_factor", path),
            original, scale if attention is None else None,
            None if attention is None else positive_float(attention, "rope_scaling.attention_factor", path),
            "original_max_position_embeddings", path)
    else:
        raise ValueError(f"{path}: rope_scaling.rope_type={rope_type!r} is not supported for Phi-3; "
                         "its RoPE is 'default' or 'longrope' (as transformers' Phi3Config)")
    window = cfg.get("sliding_window")
    return {
        "rope_theta": rope_theta,
        "rope_scaling": scaling,
        "rotary_dim": rotary if rotary < head_dim else None,
        "sliding_window": None if window is None else positive_int(window, "sliding_window", path),
    }


def longrope_scaling(short: tuple[float, ...], long: tuple[float, ...], original: int,
                     scale: float | None, attention: float | None, original_field: str,
                     path: str) -> dict[str, Any]:
    """The spec's rope_scaling for LongRoPE; the attention factor given, or from
    the context's scale as transformers (and llama.cpp's converter) compute it."""
    if original < 2:
        raise ValueError(f"{path}: {original_field}={original} is invalid; it must be at least 2")
    if attention is None:
        assert scale is not None
        attention = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": original, "attention_factor": attention}


def _factors(value: Any, rotary: int, field: str, path: str) -> tuple[float, ...]:
    """A LongRoPE factor list: rotary / 2 finite numbers > 0 (one per frequency)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple) or len(value) != rotary // 2:
        raise ValueError(f"{path}: {field} must list {rotary // 2} numbers (one per rotated pair of "
                         f"the head's {rotary} rotary dimensions), got {value!r:.80}")
    return tuple(positive_float(v, field, path) for v in value)


# --- GGUF -------------------------------------------------------------------

_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
GGUF_ROPE_TENSORS = frozenset(_FACTOR_TENSORS)  # read here, not weights


def phi3_gguf_fields(reader: GGUFFile, arch: str, head_dim: int, context_length: int) -> dict[str, Any]:
    """rope_scaling, rotary_dim and sliding_window of a `phi3` GGUF file."""
    fields, path = reader.fields, reader.path
    rotary = fields.get(f"{arch}.rope.dimension_count", head_dim)
    rotary = positive_int(rotary, f"{arch}.rope.dimension_count", path)
    if rotary % 2 or rotary > head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rotary} is invalid; it must be even "
                         f"and at most the head size {head_dim}")
    tensors = {t.name: t for t in reader.tensors if t.name in _FACTOR_TENSORS}
    scaling = None
    if tensors:
        missing = [name for name in _FACTOR_TENSORS if name not in tensors]
        if missing:
            raise ValueError(f"{path}: LongRoPE needs both {' and '.join(_FACTOR_TENSORS)}; "
                             f"{', '.join(missing)} is missing")
        short_name, long_name = _FACTOR_TENSORS
        short = _factors(_f32(tensors[short_name], path), rotary, f"tensor {short_name}", path)
        long = _factors(_f32(tensors[long_name], path), rotary, f"tensor {long_name}", path)
        key = f"{arch}.rope.scaling.original_context_length"  # (absent: the context length, as llama.cpp)
        original = positive_int(fields.get(key, context_length), key, path)
        attention = fields.get(f"{arch}.rope.scaling.attn_factor")
        scaling = longrope_scaling(
            short, long, original, context_length / original,
            None if attention is None else positive_float(attention, f"{arch}.rope.scaling.attn_factor", path),
            key, path)
    window = fields.get(f"{arch}.attention.sliding_window", 0)
    return {
        "rope_scaling": scaling,
        "rotary_dim": rotary if rotary < head_dim else None,
        "sliding_window": None if window == 0 else positive_int(window, f"{arch}.attention.sliding_window", path),
    }


def _f32(tensor: Any, path: str) -> np.ndarray:
    if tensor.data.dtype != np.float32:
        raise ValueError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}; it must be F32")
    return np.asarray(tensor.data, dtype=np.float32).reshape(-1)
