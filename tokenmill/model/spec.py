"""ModelSpec (the model's shape) from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.config import ModelSpec
from tokenmill.model.gguf_families import gguf_family
from tokenmill.model.rope import SUPPORTED_ROPE_TYPES
from tokenmill.model.spec_bert import ENCODER_ARCHITECTURES, ENCODER_MODEL_TYPES, encoder_spec
from tokenmill.model.spec_checks import positive_float as _positive_float
from tokenmill.model.spec_checks import positive_int as _positive_int
from tokenmill.model.spec_gemma import (
    GEMMA_ARCHITECTURES,
    gemma_config,
    gemma_fields,
    gemma_gguf_fields,
    layer_types,
)
from tokenmill.model.spec_moe import MOE_ARCHITECTURES, moe_gguf_fields, moe_hf_fields
from tokenmill.model.spec_phi3 import (
    PHI3_ARCHITECTURES,
    phi3_config,
    phi3_gguf_fields,
    phi3_hf_fields,
)

if TYPE_CHECKING:
    from tokenmill.model.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *GEMMA_ARCHITECTURES,
    *PHI3_ARCHITECTURES,
    *MOE_ARCHITECTURES,
)
# Checkpoints saved without their LM head (Qwen3-Embedding ships as Qwen3Model):
# the decoder they are, pooling only (ModelSpec.headless).
HEADLESS_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
# Positions no released model reaches (Llama 4 Scout: 10M). A larger context
# length is a corrupt file, refused before the RoPE table is allocated for it.
MAX_CONTEXT_LENGTH = 1 << 24
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def spec_from_hf_config(cfg: Mapping[str, Any], path: str = "config.json") -> ModelSpec:
    """A ModelSpec from a parsed config.json (read from `path`, named in errors).
    generation_config.json's EOS ids, which take precedence, are applied by the
    loader. A value out of its range is a ValueError naming the file and field:
    a corrupt config must not load as a model that generates garbage."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{path} must hold a JSON object, got a {type(cfg).__name__}")
    architecture = _hf_architecture(cfg)
    if architecture in ENCODER_ARCHITECTURES:
        return encoder_spec(cfg, architecture, path)
    if architecture in HEADLESS_ARCHITECTURES:
        spec = spec_from_hf_config({**cfg, "architectures": [HEADLESS_ARCHITECTURES[architecture]]}, path)
        return dataclasses.replace(spec, headless=True, tie_word_embeddings=True)
    gemma = architecture in GEMMA_ARCHITECTURES
    if gemma:
        cfg = gemma_config(cfg, architecture, path)
    elif architecture in PHI3_ARCHITECTURES:
        cfg = phi3_config(cfg)
    num_heads = _positive_int(_require(cfg, "num_attention_heads", path), "num_attention_heads", path)
    hidden_size = _positive_int(_require(cfg, "hidden_size", path), "hidden_size", path)
    max_position_embeddings = _context_length(_positive_int(
        _require(cfg, "max_position_embeddings", path), "max_position_embeddings", path
    ), "max_position_embeddings", path)
    vocab_size = _positive_int(_require(cfg, "vocab_size", path), "vocab_size", path)
    if not gemma and cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; only 'silu' is")
    if cfg.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    head_dim = _head_dim(cfg.get("head_dim"), hidden_size, num_heads, "head_dim", "hidden_size",
                         "num_attention_heads", path)
    phi3 = phi3_hf_fields(cfg, head_dim, max_position_embeddings, path) if (
        architecture in PHI3_ARCHITECTURES) else None
    if phi3 is not None:
        rope_theta, rope_scaling = phi3.pop("rope_theta"), phi3.pop("rope_scaling")
    else:
        rope_theta, rope_scaling = _hf_rope(cfg, max_position_embeddings, path)
    if architecture == "Qwen2ForCausalLM":
        attention_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
    elif architecture in ("MistralForCausalLM", "MixtralForCausalLM", *PHI3_ARCHITECTURES):
        attention_bias = False
    else:
        attention_bias = bool(cfg.get("attention_bias", False))
    bos = cfg.get("bos_token_id")
    num_kv_heads = _kv_heads(cfg.get("num_key_value_heads"), num_heads, "num_key_value_heads",
                             "num_attention_heads", path)
    num_layers = _positive_int(_require(cfg, "num_hidden_layers", path), "num_hidden_layers", path)
    family: dict[str, Any] = (
        gemma_fields(cfg, architecture, num_layers, path) if gemma else phi3 if phi3 is not None else
        {"qk_norm": architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
         "sliding_window": _hf_sliding_window(cfg, architecture, path)})
    if architecture == "GptOssForCausalLM":  # alternating windowed and global layers
        family = {"layer_types": layer_types(cfg, architecture, num_layers, path),
                  "sliding_window": _positive_int(_require(cfg, "sliding_window", path), "sliding_window", path)}
    if architecture in MOE_ARCHITECTURES:
        family.update(moe_hf_fields(cfg, architecture, num_layers, path))
    return ModelSpec(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_positive_int(
            _require(cfg, "intermediate_size", path), "intermediate_size", path
        ),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", path),
        rope_theta=_positive_float(rope_theta, "rope_theta", path),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else _token_id(bos, vocab_size, "bos_token_id", path),
        eos_token_ids=eos_token_ids(cfg.get("eos_token_id"), vocab_size, path),
        **family,
    )


def eos_token_ids(
    value: Any, vocab_size: int | None = None, path: str = "config.json"
) -> tuple[int, ...]:
    """config.json / generation_config.json `eos_token_id` (int, list or null) as a
    tuple; each must be a token id (below `vocab_size` when given)."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(_token_id(v, vocab_size, "eos_token_id", path) for v in values)


def _require(cfg: Mapping[str, Any], key: str, path: str = "config.json") -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"{path} has no {key!r}; is this a complete model config?")
    return cfg[key]


def _token_id(value: Any, vocab_size: int | None, field: str, path: str) -> int:
    """A special token id: an int in [0, vocab_size)."""
    if (isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0
            or (vocab_size is not None and value >= vocab_size)):
        limit = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(
            f"{path}: {field}={value!r} is invalid; it must be a token id (an integer {limit}, "
            "the vocabulary's size)"
        )
    return int(value)


def _kv_heads(value: Any, num_heads: int, field: str, heads_field: str, path: str) -> int:
    """The KV head count (absent: one per query head); it must divide the head count."""
    if value is None:
        return num_heads
    kv_heads = _positive_int(value, field, path)
    if num_heads % kv_heads:
        raise ValueError(
            f"{path}: {field}={kv_heads} is invalid; it must divide {heads_field}={num_heads}"
        )
    return kv_heads


def _head_dim(value: Any, hidden_size: int, num_heads: int, field: str, hidden_field: str,
              heads_field: str, path: str) -> int:
    """The per-head size: given, or hidden size / head count (which must divide);
    even either way, since RoPE rotates pairs."""
    if value is not None:
        head_dim = _positive_int(value, field, path)
    elif hidden_size % num_heads:
        raise ValueError(
            f"{path}: {hidden_field}={hidden_size} is not divisible by {heads_field}={num_heads}; "
            f"the head size must be a whole number (or give {field})"
        )
    else:
        head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ValueError(f"{path}: the head size ({field}) {head_dim} must be even for RoPE")
    return head_dim


def _hf_architecture(cfg: Mapping[str, Any]) -> str:
    architectures = cfg.get("architectures") or []
    if architectures:
        architecture = str(architectures[0])
    else:
        model_type = cfg.get("model_type")
        architecture = {**_ARCHITECTURE_BY_MODEL_TYPE, **ENCODER_MODEL_TYPES}.get(
            str(model_type), f"model_type={model_type!r}"
        )
    known = (*SUPPORTED_ARCHITECTURES, *HEADLESS_ARCHITECTURES, *ENCODER_ARCHITECTURES)
    if architecture not in known:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(known)}"
        )
    return architecture


def _hf_rope(
    cfg: Mapping[str, Any], max_position_embeddings: int, path: str
) -> tuple[Any, dict[str, Any] | None]:
    # transformers 5 writes `rope_parameters` (rope_theta inside); older configs
    # write `rope_theta` plus an optional `rope_scaling` (with "type" or "rope_type").
    for field in ("rope_parameters", "rope_scaling"):
        value = cfg.get(field)
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(
                f"{path}: {field}={value!r} is invalid; it must be an object "
                '(like {"rope_type": "linear", "factor": 2.0}) or null'
            )
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
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


def _hf_sliding_window(cfg: Mapping[str, Any], architecture: str, path: str) -> int | None:
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = cfg.get("sliding_window")
        return _positive_int(window, "sliding_window", path) if window is not None else None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
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
            return _positive_int(cfg["sliding_window"], "sliding_window", path)
        raise ValueError(
            "a sliding window on only some layers (max_window_layers / layer_types) is not "
            "supported; use a config with use_sliding_window=false"
        )
    return None


# --- GGUF -------------------------------------------------------------------


def spec_from_gguf(reader: GGUFFile) -> ModelSpec:
    """A ModelSpec from a GGUF file's metadata, for any architecture of
    gguf_families.GGUF_FAMILIES (its keys are `{arch}.<key>`). A value out of its
    range is a ValueError naming the file and the key, before anything is
    allocated: sizes that the tensors must bear out (the layer count here, the
    others by the loader's shape check on a model built on the meta device),
    the context length below MAX_CONTEXT_LENGTH, the vocabulary's size equal to
    the token list's."""
    fields = reader.fields
    path = reader.path
    arch = fields.get("general.architecture")
    family = gguf_family(arch, path)

    def require(key: str) -> Any:
        value = fields.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF file has no '{arch}.{key}' metadata")
        return value

    def positive_int(key: str) -> int:
        return _positive_int(require(key), f"{arch}.{key}", path)

    hidden_size = positive_int("embedding_length")
    num_heads = positive_int("attention.head_count")
    head_dim = _head_dim(fields.get(f"{arch}.attention.key_length"), hidden_size, num_heads,
                         f"{arch}.attention.key_length", f"{arch}.embedding_length",
                         f"{arch}.attention.head_count", path)
    value_length = fields.get(f"{arch}.attention.value_length")
    if value_length is not None and value_length != head_dim:
        raise ValueError(
            f"{path}: {arch}.attention.value_length={value_length!r} is not supported; values "
            f"must have the keys' head size ({head_dim})"
        )
    num_kv_heads = _kv_heads(fields.get(f"{arch}.attention.head_count_kv"), num_heads,
                             f"{arch}.attention.head_count_kv", f"{arch}.attention.head_count", path)
    rope_dim = fields.get(f"{arch}.rope.dimension_count")
    phi3 = family.architecture in PHI3_ARCHITECTURES  # (partial rotary: phi3_gguf_fields)
    if rope_dim is not None and rope_dim != head_dim and not phi3:
        source = (f"{arch}.attention.key_length" if f"{arch}.attention.key_length" in fields else
                  f"{arch}.embedding_length={hidden_size} / {arch}.attention.head_count={num_heads}")
        raise ValueError(
            f"{path}: {arch}.rope.dimension_count={rope_dim!r} is not the head size {head_dim} "
            f"({source}): partial rotary embeddings are not supported, or a size is corrupt"
        )
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens; it cannot be used alone")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: tokenizer.ggml.tokens must be a non-empty list of strings")
    vocab_size = len(tokens)
    stated_vocab = fields.get(f"{arch}.vocab_size")
    if stated_vocab is not None and stated_vocab != vocab_size:
        raise ValueError(
            f"{path}: {arch}.vocab_size={stated_vocab!r} is invalid; it must be the number of "
            f"tokens in tokenizer.ggml.tokens ({vocab_size})"
        )
    # Every special token id (bos, eos, eot, unknown, padding, ...) must be a token.
    for key, value in fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            _token_id(value, vocab_size, key, path)
    tensor_names = {t.name for t in reader.tensors}
    eos_ids: list[int] = []
    # llama.cpp stops generation at any of these (its "end of generation" set).
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    rope_theta = fields.get(f"{arch}.rope.freq_base")
    num_layers = _gguf_block_count(reader, positive_int("block_count"), f"{arch}.block_count")
    context_length = _context_length(positive_int("context_length"), f"{arch}.context_length", path)
    extra: dict[str, Any] = {}
    if family.architecture in GEMMA_ARCHITECTURES:
        extra = gemma_gguf_fields(fields, str(arch), family.architecture, num_layers, hidden_size, num_heads,
                                  head_dim, path)
    rope_scaling: dict[str, Any] | None
    if phi3:
        extra = phi3_gguf_fields(reader, str(arch), head_dim, context_length)
        rope_scaling = extra.pop("rope_scaling")
    else:
        rope_scaling = _gguf_rope_scaling(reader, str(arch))
    moe = moe_gguf_fields(fields, str(arch), num_layers, tensor_names, path)
    extra.update(moe)
    # (llama.cpp converts Mixtral as `llama`, its experts making the difference)
    architecture = "MixtralForCausalLM" if moe and family.architecture == "LlamaForCausalLM" else family.architecture
    return ModelSpec(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=positive_int("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive_float(require("attention.layer_norm_rms_epsilon"),
                                     f"{arch}.attention.layer_norm_rms_epsilon", path),
        rope_theta=10000.0 if rope_theta is None else _positive_float(
            rope_theta, f"{arch}.rope.freq_base", path),
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=family.attention_bias,
        qk_norm=family.qk_norm,
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        **extra,
    )


def _gguf_block_count(reader: GGUFFile, block_count: int, field: str) -> int:
    """The layer count, which must be the number of layers (blk.N) the tensors hold."""
    layers = {int(m.group(1)) for t in reader.tensors if (m := _GGUF_LAYER_RE.match(t.name))}
    if block_count != len(layers):
        raise ValueError(
            f"{reader.path}: {field}={block_count} is invalid; the file's tensors are of "
            f"{len(layers)} layers (blk.N)"
        )
    return block_count


def _context_length(value: int, field: str, path: str) -> int:
    if value > MAX_CONTEXT_LENGTH:
        raise ValueError(
            f"{path}: {field}={value} is invalid; it must be at most {MAX_CONTEXT_LENGTH} "
            "(2**24 positions, beyond any released model's context): the file is corrupt"
        )
    return value


def _gguf_rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    fields = reader.fields
    # Llama 3.x GGUFs carry their rope scaling as per-frequency divisors.
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            if tensor.data.dtype != np.float32:
                raise ValueError(f"{reader.path}: tensor rope_freqs.weight has type "
                                 f"{tensor.tensor_type.name}; it must be F32")
            factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            if not (np.isfinite(factors).all() and (factors > 0).all()):
                raise ValueError(f"{reader.path}: tensor rope_freqs.weight holds values that are "
                                 "not finite numbers > 0")
            return {"rope_type": "freq_factors", "freq_factors": tuple(float(f) for f in factors)}
    rope_type = fields.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type == "linear":
        factor = fields.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ValueError(f"{reader.path}: GGUF file has linear rope scaling but no "
                             f"'{arch}.rope.scaling.factor'")
        return {"rope_type": "linear",
                "factor": _positive_float(factor, f"{arch}.rope.scaling.factor", reader.path)}
    raise ValueError(f"{reader.path}: GGUF rope scaling type {arch}.rope.scaling.type="
                     f"{rope_type!r} is not supported")
