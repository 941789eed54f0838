"""Tiny random Llama-family models built from transformers configs, saved to a
temp dir, for tests that use transformers as the oracle. Nothing is downloaded."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers

VOCAB_SIZE = 256

# The device the engine runs on in the engine-level tests (transformers, the oracle,
# stays on the CPU): `TOKENMILL_TEST_DEVICE=cuda pytest tests/test_correctness.py`
# checks the CUDA path where a GPU is. CI has none and runs "cpu".
TEST_DEVICE = os.environ.get("TOKENMILL_TEST_DEVICE", "cpu")

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    # Wider than the default 0.02, so the logits of a random model are spread out
    # and greedy choices are not decided by float rounding.
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# LongRoPE's factors for a head of 16 with 12 rotated: one per rotated pair.
PHI_SHORT_FACTOR = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
PHI_LONG_FACTOR = [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-tied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    # A window of 8 (shorter than most prompts) on the first layer, the second
    # global; Gemma 3's layers with their own RoPE bases and q/k norms; Gemma 2's
    # soft-caps low enough to bend the scores and logits.
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    }),
    "gemma2": ("Gemma2Config", {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0,
    }),
    # Phi-3 (fused qkv_proj and gate_up_proj) with a window of 16 on every layer, as
    # Phi-3-mini-4k's 2047; pad_token_id inside the vocabulary (Phi3Config's is 32000).
    "phi3": ("Phi3Config", {"sliding_window": 16, "pad_token_id": 0}),
    # Phi-4-mini's kind: 3/4 of each head rotated, LongRoPE, a tied head. The original
    # context (96) is past every test's sequences, where transformers and tokenmill
    # agree exactly (model/rope.py): the short factors, and cos/sin times the attention
    # factor sqrt(1 + ln(512 / 96) / ln(96)).
    "phi4-mini": ("Phi3Config", {
        "pad_token_id": 0, "tie_word_embeddings": True, "original_max_position_embeddings": 96,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": PHI_SHORT_FACTOR, "long_factor": PHI_LONG_FACTOR},
    }),
    # Mixtures of experts: Qwen3-MoE's q/k norms, 8 experts of 32, top 2 not
    # renormalised, its second layer dense (mlp_only_layers); Mixtral's 4 experts
    # of 32, top 2 renormalised.
    "qwen3-moe": ("Qwen3MoeConfig", {
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": False, "mlp_only_layers": [1],
    }),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                  "sliding_window": None}),
    # gpt-oss: a window of 8 on its first layer, the second global; sinks; biases
    # everywhere; 4 experts of 32, top 2; YaRN (factor 4 over an original 128, so
    # the interpolated and extrapolated bands both show within 512 positions).
    "gpt-oss": ("GptOssConfig", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
    }),
}


def build_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    config_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if arch.startswith(("gemma", "phi", "gpt-oss")):  # norms start equal: spread them, so a swapped or lost one shows
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:  # (Gemma's (1 + w) starts at w = 0, the others' at 1)
                    param.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.3)
                if name.endswith(("sinks", "bias")):  # (gpt-oss: zeros at init would hide them)
                    param.normal_(0.0, 0.5)
    # Generation runs to max_new_tokens: no EOS, like ignore_eos on our side.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model: torch.nn.Module, directory: Path) -> str:
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


@torch.inference_mode()
def hf_embedding(model: Any, prompt: list[int], pooling: str, normalize: bool) -> np.ndarray:
    """transformers' last hidden state (after the final norm) of a causal LM's base
    model for one prompt alone, pooled ("last", "mean" or "cls") as
    sentence-transformers pools it."""
    hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]  # [len, hidden]
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return np.asarray(vector.numpy())


@torch.inference_mode()
def hf_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the logprob of each under the raw logits."""
    out = model.generate(  # type: ignore[operator]
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step_logits[0].float(), dim=-1)[tok].item()
        for step_logits, tok in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


# --- writing a tiny HF model as a GGUF file, as llama.cpp would ----------------

HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    # Phi-3's fused tensors, as llama.cpp keeps them (ffn_up: gate and up rows).
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    # A mixture of experts' router and stacked experts (transformers 5 holds
    # gate and up fused [E, 2I, H]: gguf_tensors splits them as llama.cpp's converter).
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
}
# Gemma's four norms under llama.cpp's names (its ffn_norm is the MLP's input norm).
GEMMA_TO_GGUF = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA_TYPES = ("gemma2", "gemma3_text")
# llama.cpp's converter permutes Q/K rows for these model types only.
PERMUTED_QK = ("llama", "mistral", "mixtral")


def gguf_writer(hf_model: Any, path: Path, arch: str = "llama") -> gguf.GGUFWriter:
    """A GGUFWriter with hf_model's metadata, under `arch`'s keys as llama.cpp's
    converter writes them (and a made-up tokenizer) added."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if getattr(cfg, "head_dim", None) is not None:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.model_type == "phi3":  # llama.cpp's Phi3MiniModel.set_gguf_parameters
        writer.add_rope_dimension_count(
            int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        writer.add_sliding_window(cfg.sliding_window or 0)
    if cfg.model_type in GEMMA_TYPES:  # (Gemma 2 adds its soft-caps; the window pattern: gguf_tensors' caller)
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:  # (llama.cpp writes Qwen3-MoE's expert width; Mixtral's is feed_forward_length)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.model_type == "qwen3_moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def gguf_tensors(hf_model: Any) -> Iterator[tuple[str, str, int | None, np.ndarray, torch.Tensor]]:
    """(GGUF name, part, RoPE heads or None, float32 weight in llama.cpp's row
    order, the HF parameter) for each tensor a GGUF file holds (a tied head is
    not written). Q/K rows are permuted (RoPE heads given) for Llama-style
    models only, and Gemma's norm weights stored as 1 + w, as llama.cpp's
    converter does."""
    cfg = hf_model.config
    permuted = cfg.model_type in PERMUTED_QK
    gemma = cfg.model_type in GEMMA_TYPES
    for name, param in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            halves = param.view(param.shape[0], 2, -1, param.shape[-1])  # (views: a caller may write them)
            for half, part in ((halves[:, 0], "ffn_gate_exps"), (halves[:, 1], "ffn_up_exps")):
                yield f"blk.{parts[2]}.{part}.weight", part, None, np.ascontiguousarray(half.float().numpy()), half
            continue
        if name.endswith("mlp.experts.down_proj"):
            yield f"blk.{parts[2]}.ffn_down_exps.weight", "ffn_down_exps", None, param.float().numpy(), param
            continue
        if name.startswith("model.layers."):
            module = ".".join(parts[3:-1])
            part = GEMMA_TO_GGUF[module] if gemma and module in GEMMA_TO_GGUF else HF_TO_GGUF[module]
            gguf_name = f"blk.{parts[2]}.{part}.{parts[-1]}"
        else:
            part = {
                "model.embed_tokens": "token_embd",
                "model.norm": "output_norm",
                "lm_head": "output",
            }[".".join(parts[:-1])]
            gguf_name = f"{part}.weight"
        weight = param.float().numpy()
        if gemma and name.endswith("norm.weight"):
            weight = weight + np.float32(1.0)
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(part)
        if not permuted:
            heads = None
        if heads is not None:  # llama.cpp's permutation for its RoPE layout
            weight = (
                weight.reshape(heads, 2, -1, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
            )
        yield gguf_name, part, heads, weight, param


def add_phi3_rope_factors(hf_model: Any, writer: gguf.GGUFWriter) -> None:
    """A LongRoPE Phi-3's factors and attention factor, as llama.cpp's converter
    writes them (generate_extra_tensors): the factor from the context's scale."""
    cfg = hf_model.config
    rope = cfg.rope_parameters
    if rope.get("rope_type") != "longrope":
        return
    scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def finish_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
