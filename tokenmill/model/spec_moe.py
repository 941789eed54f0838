"""Mixture-of-experts ModelSpec fields (Qwen3-MoE, Mixtral, gpt-oss) from a config.json or GGUF metadata.

Each is the Llama layer with its MLP replaced, in the layers that say so, by a
router and `num_experts` SwiGLU experts (model/llama.py SparseMoeBlock):
Qwen3-MoE is Qwen3's attention (q/k norms), Mixtral Mistral's. gpt-oss adds
biases on the attention's projections, the router and the experts, attention
sinks, alternating sliding and global layers, YaRN, a router that softmaxes its
top k logits, a clamped SwiGLU and RMSNorms scaled in float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.model.spec_checks import positive_float, positive_int

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
# More experts than any released model has (Qwen3-Next: 512): a corrupt count,
# refused before a module is built for each.
MAX_EXPERTS = 1 << 12


def moe_hf_fields(cfg: Mapping[str, Any], architecture: str, num_layers: int, path: str) -> dict[str, Any]:
    """The MoE fields of a config.json; a value out of range is a ValueError naming it."""
    dense: tuple[int, ...]
    if architecture == "GptOssForCausalLM":
        fields = _checked(positive_int(cfg.get("num_local_experts"), "num_local_experts", path),
                          cfg.get("num_experts_per_tok"), "num_experts_per_tok",
                          positive_int(cfg.get("intermediate_size"), "intermediate_size", path), False, (), path)
        # (the family's fixed fields, its SwiGLU's clamp and slope as the config says them)
        return {**fields, **_GPT_OSS_FIXED, **{key: positive_float(cfg.get(key, _GPT_OSS_FIXED[key]), key, path)
                                               for key in ("swiglu_limit", "swiglu_alpha")}}
    if architecture == "MixtralForCausalLM":
        experts = positive_int(cfg.get("num_local_experts", 8), "num_local_experts", path)
        width = positive_int(cfg.get("intermediate_size"), "intermediate_size", path)
        norm, dense = True, ()  # Mixtral: every layer's MLP is sparse, its top k renormalised
    else:
        # (transformers 5 saves Qwen3-MoE's num_experts as num_local_experts)
        field = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
        experts = positive_int(cfg.get(field), field, path)
        width = positive_int(cfg.get("moe_intermediate_size"), "moe_intermediate_size", path)
        norm = bool(cfg.get("norm_topk_prob", False))
        step = positive_int(cfg.get("decoder_sparse_step", 1), "decoder_sparse_step", path)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in only):
            raise ValueError(f"{path}: mlp_only_layers={only!r} is invalid; it must list layer indices "
                             f"below num_hidden_layers={num_layers}")
        # transformers' rule: sparse where not in mlp_only_layers and (i + 1) % step == 0
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return _checked(experts, cfg.get("num_experts_per_tok", 2), "num_experts_per_tok", width, norm, dense, path)


def moe_gguf_fields(fields: Mapping[str, Any], arch: str, num_layers: int, tensor_names: set[str],
                    path: str) -> dict[str, Any]:
    """The MoE fields of a GGUF's `{arch}.` keys (none: a dense model, {}).
    llama.cpp's qwen3moe and llama (Mixtral) graphs renormalise the top k weights
    unless the file says otherwise (`expert_weights_norm`). A layer without a
    router (`blk.N.ffn_gate_inp`) keeps its dense MLP (Qwen3-MoE's mlp_only_layers)."""
    experts = fields.get(f"{arch}.expert_count")
    if not experts:
        return {}
    experts = positive_int(experts, f"{arch}.expert_count", path)
    width = fields.get(f"{arch}.expert_feed_forward_length", fields.get(f"{arch}.feed_forward_length"))
    width = positive_int(width, f"{arch}.expert_feed_forward_length", path)
    norm = bool(fields.get(f"{arch}.expert_weights_norm", True))
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    return _checked(experts, fields.get(f"{arch}.expert_used_count"), f"{arch}.expert_used_count", width, norm,
                    dense, path)


# gpt-oss's fields: what its layer always has, and the SwiGLU's clamp and slope that a
# config.json may say and a GGUF file does not (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE fixes them).
_GPT_OSS_FIXED = {"moe_bias": True, "moe_topk_then_softmax": True, "attention_sinks": True,
                  "norm_in_float32": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def gpt_oss_gguf_fields(fields: Mapping[str, Any], arch: str, num_layers: int, path: str) -> dict[str, Any]:
    """A `gpt-oss` file's window and layer pattern (`attention.sliding_window`;
    `attention.sliding_window_pattern`, else every 2nd layer global, as llama.cpp),
    and what its graph fixes."""
    window = positive_int(fields.get(f"{arch}.attention.sliding_window"), f"{arch}.attention.sliding_window", path)
    pattern = positive_int(fields.get(f"{arch}.attention.sliding_window_pattern", 2),
                           f"{arch}.attention.sliding_window_pattern", path)
    types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    return {**_GPT_OSS_FIXED, "sliding_window": window, "layer_types": types}


def _checked(experts: int, top_k: Any, top_k_field: str, width: int, norm: bool, dense: tuple[int, ...],
             path: str) -> dict[str, Any]:
    if experts > MAX_EXPERTS:
        raise ValueError(f"{path}: {experts} experts is invalid; at most {MAX_EXPERTS} (beyond any released "
                         "model): the file is corrupt")
    top_k = positive_int(top_k, top_k_field, path)
    if top_k > experts:
        raise ValueError(f"{path}: {top_k_field}={top_k} is invalid; a token picks at most the "
                         f"{experts} experts there are")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
            "norm_topk_prob": norm, "dense_layers": dense}
