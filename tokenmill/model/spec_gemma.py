"""Gemma 2 and Gemma 3 (text): their ModelSpec fields from a config.json or
from a GGUF file's metadata.

A Gemma layer is the Llama layer with the ModelSpec's Gemma fields set
(model/llama.py). A field a config.json leaves out takes transformers' default
for its class (Gemma2Config, Gemma3TextConfig), so an older config (rope_theta,
rope_local_base_freq, sliding_window_pattern) and transformers 5's
(rope_parameters per layer type, layer_types) give the same spec. A GGUF file
is read as llama.cpp reads it (src/models/gemma2.cpp, gemma3.cpp): what its
converter does not write takes llama.cpp's value (the window pattern, the
sliding layers' RoPE base, the query scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.model.spec_checks import positive_float, positive_int

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = "gelu_pytorch_tanh"

# transformers' defaults for what a config.json may leave out.
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "Gemma2ForCausalLM": {
        "head_dim": 256, "hidden_activation": GELU_TANH, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    },
    "Gemma3ForCausalLM": {
        "head_dim": 256, "hidden_activation": GELU_TANH, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
    },
}
# Without layer_types: every n-th layer global, the others sliding.
_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "GptOssForCausalLM": 2}


def gemma_config(cfg: Mapping[str, Any], architecture: str, path: str) -> dict[str, Any]:
    """`cfg` with its class's defaults filled in, its RoPE fields as the generic
    reader (spec._hf_rope) takes them: Gemma 3's per-layer-type rope_parameters
    become the global layers' (the sliding layers' base: gemma_fields)."""
    out = {**_DEFAULTS[architecture], **cfg}
    params = out.get("rope_parameters")
    if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
        full, local = params.get(FULL), params.get(SLIDING)
        for name, value in ((FULL, full), (SLIDING, local)):
            if not isinstance(value, Mapping | None):
                raise ValueError(f"{path}: rope_parameters.{name}={value!r} is invalid; it must be an object")
        out["rope_parameters"] = full
        if local is not None:  # HF's sliding layers: plain RoPE at their own base
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"{path}: rope_parameters.{SLIDING}.rope_type={local['rope_type']!r} is "
                                 "not supported; the sliding layers' RoPE must be 'default'")
            out["rope_local_base_freq"] = local.get("rope_theta", out.get("rope_local_base_freq"))
    return out


_LAYER = {"hidden_act": GELU_TANH, "norm_unit_offset": True, "sandwich_norms": True, "scale_embeddings": True}


def gemma_fields(cfg: Mapping[str, Any], architecture: str, num_layers: int,
                 path: str) -> dict[str, Any]:
    """The ModelSpec fields of a Gemma config (`cfg` from gemma_config)."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention=true (an embedding model's "
                         "attention) is not supported; only causal Gemma models are")
    act = cfg.get("hidden_activation")
    if act != GELU_TANH:
        raise ValueError(f"{path}: hidden_activation={act!r} is not supported; Gemma's is {GELU_TANH!r}")
    window = cfg.get("sliding_window")
    return {
        **_LAYER,
        "qk_norm": architecture == "Gemma3ForCausalLM",
        "query_pre_attn_scalar": positive_float(cfg.get("query_pre_attn_scalar"), "query_pre_attn_scalar",
                                                path),
        "sliding_window": None if window is None else positive_int(window, "sliding_window", path),
        "layer_types": layer_types(cfg, architecture, num_layers, path),
        "local_rope_theta": (positive_float(cfg.get("rope_local_base_freq"), "rope_local_base_freq", path)
                             if architecture == "Gemma3ForCausalLM" else None),
        "attn_logit_softcapping": _cap(cfg, "attn_logit_softcapping", path),
        "final_logit_softcapping": _cap(cfg, "final_logit_softcapping", path),
    }


def layer_types(cfg: Mapping[str, Any], architecture: str, num_layers: int, path: str) -> tuple[str, ...]:
    """Each layer's "sliding_attention" or "full_attention": the config's `layer_types`,
    else every n-th layer global (the family's n; gpt-oss's too)."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = positive_int(
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or _PATTERN[architecture],
            "sliding_window_pattern", path)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"{path}: layer_types must list {num_layers} entries (num_hidden_layers), "
                         f"each {SLIDING!r} or {FULL!r}")
    return tuple(types)


def _cap(cfg: Mapping[str, Any], field: str, path: str) -> float | None:
    value = cfg.get(field)
    return None if value is None else positive_float(value, field, path)


# llama.cpp's layer counts of the 27B models, whose query scale is hidden / heads.
_27B_LAYERS = {"Gemma2ForCausalLM": 46, "Gemma3ForCausalLM": 62}


def gemma_gguf_fields(fields: Mapping[str, Any], arch: str, architecture: str, num_layers: int,
                      hidden_size: int, num_heads: int, head_dim: int, path: str) -> dict[str, Any]:
    """The ModelSpec fields of a Gemma GGUF file (`fields`: its metadata, keys `{arch}.*`)."""
    gemma2 = architecture == "Gemma2ForCausalLM"

    def number(key: str, default: float | None) -> float | None:
        value = fields.get(f"{arch}.{key}", default)
        return None if value is None else positive_float(value, f"{arch}.{key}", path)

    window = fields.get(f"{arch}.attention.sliding_window", 4096 if gemma2 else None)
    if window == 0:  # (llama.cpp: no sliding window)
        window = None
    if window is not None:
        window = positive_int(window, f"{arch}.attention.sliding_window", path)
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern", 2 if gemma2 else 6)
    field = f"{arch}.attention.sliding_window_pattern"
    if isinstance(pattern, list):  # a flag a layer
        if len(pattern) != num_layers or any(not isinstance(p, bool) for p in pattern):
            raise ValueError(f"{path}: {field} must hold {num_layers} booleans ({arch}.block_count)")
        sliding = list(pattern)
    else:  # every n-th layer global (0: none)
        n = 0 if pattern == 0 else positive_int(pattern, field, path)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    types = tuple(SLIDING if s and window is not None else FULL for s in sliding)
    scalar = hidden_size // num_heads if num_layers == _27B_LAYERS[architecture] else head_dim
    return {
        **_LAYER,
        "sliding_window": window,
        "layer_types": types,
        "local_rope_theta": None if gemma2 else number("rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": float(scalar),
        "attn_logit_softcapping": number("attn_logit_softcapping", 50.0) if gemma2 else None,
        "final_logit_softcapping": number("final_logit_softcapping", 30.0 if gemma2 else None),
    }
