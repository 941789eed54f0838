"""ModelSpec (the model's shape) from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.config import ModelSpec
from tokenmill.model.rope import SUPPORTED_ROPE_TYPES

if TYPE_CHECKING:
    from tokenmill.model.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def spec_from_hf_config(cfg: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a parsed config.json. generation_config.json's EOS ids,
    which take precedence, are applied by the loader."""
    architecture = _hf_architecture(cfg)
    num_heads = _require(cfg, "num_attention_heads")
    hidden_size = _require(cfg, "hidden_size")
    max_position_embeddings = _require(cfg, "max_position_embeddings")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; only 'silu' is")
    if cfg.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    rope_theta, rope_scaling = _hf_rope(cfg, max_position_embeddings)
    if architecture == "Qwen2ForCausalLM":
        attention_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
    elif architecture == "MistralForCausalLM":
        attention_bias = False
    else:
        attention_bias = bool(cfg.get("attention_bias", False))
    eos = cfg.get("eos_token_id")
    return ModelSpec(
        architecture=architecture,
        vocab_size=_require(cfg, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_require(cfg, "intermediate_size"),
        num_layers=_require(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden_size // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_window=_hf_sliding_window(cfg, architecture),
        rope_scaling=rope_scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_token_ids(eos),
    )


def eos_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """config.json / generation_config.json `eos_token_id` (int, list or null) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config.json has no {key!r}; is this a complete model config?")
    return cfg[key]


def _hf_architecture(cfg: Mapping[str, Any]) -> str:
    architectures = cfg.get("architectures") or []
    if architectures:
        architecture = str(architectures[0])
    else:
        model_type = cfg.get("model_type")
        architecture = _ARCHITECTURE_BY_MODEL_TYPE.get(
            str(model_type), f"model_type={model_type!r}"
        )
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _hf_rope(
    cfg: Mapping[str, Any], max_position_embeddings: int
) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes `rope_parameters` (rope_theta inside); older configs
    # write `rope_theta` plus an optional `rope_scaling` (with "type" or "rope_type").
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer rope parameters are not supported")
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return rope_theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    return rope_theta, {"rope_type": rope_type, **params}


def _hf_sliding_window(cfg: Mapping[str, Any], architecture: str) -> int | None:
    if architecture == "MistralForCausalLM":
        window = cfg.get("sliding_window")
        return int(window) if window is not None else None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
            return None
        # Qwen slides only in layers >= max_window_layers; we support all or none.
        num_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 0) else "full_attention"
            for i in range(num_layers)
        ]
        if all(t == "full_attention" for t in layer_types):
            return None
        if all(t == "sliding_attention" for t in layer_types):
            return int(cfg["sliding_window"])
        raise ValueError(
            "a sliding window on only some layers (max_window_layers / layer_types) is not "
            "supported; use a config with use_sliding_window=false"
        )
    return None


# --- GGUF -------------------------------------------------------------------


def spec_from_gguf(reader: GGUFFile) -> ModelSpec:
    """A ModelSpec from a GGUF file's metadata (Llama architecture only)."""
    fields = reader.fields
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; only 'llama' GGUF files "
            "(Llama, SmolLM2, Mistral-style) are; use a Hugging Face directory instead"
        )

    def require(key: str) -> Any:
        value = fields.get(f"llama.{key}")
        if value is None:
            raise ValueError(f"GGUF file has no 'llama.{key}' metadata")
        return value

    hidden_size = int(require("embedding_length"))
    num_heads = int(require("attention.head_count"))
    num_kv_heads = int(fields.get("llama.attention.head_count_kv") or num_heads)
    head_dim = int(fields.get("llama.attention.key_length") or hidden_size // num_heads)
    rope_dim = fields.get("llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(
            f"partial rotary embeddings (rope.dimension_count={rope_dim} != head_dim={head_dim}) "
            "are not supported"
        )
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens; it cannot be used alone")
    tensor_names = {t.name for t in reader.tensors}
    eos_ids: list[int] = []
    # llama.cpp stops generation at any of these (its "end of generation" set).
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ModelSpec(
        architecture="LlamaForCausalLM",
        vocab_size=len(tokens),
        hidden_size=hidden_size,
        intermediate_size=int(require("feed_forward_length")),
        num_layers=int(require("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(require("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get("llama.rope.freq_base") or 10000.0),
        max_position_embeddings=int(require("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_gguf_rope_scaling(reader),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


def _gguf_rope_scaling(reader: GGUFFile) -> dict[str, Any] | None:
    fields = reader.fields
    # Llama 3.x GGUFs carry their rope scaling as per-frequency divisors.
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            return {"rope_type": "freq_factors", "freq_factors": tuple(float(f) for f in factors)}
    rope_type = fields.get("llama.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type == "linear":
        factor = fields.get("llama.rope.scaling.factor")
        if factor is None:
            raise ValueError("GGUF file has linear rope scaling but no 'llama.rope.scaling.factor'")
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(f"GGUF rope scaling type {rope_type!r} is not supported")
