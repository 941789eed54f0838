"""Tiny random Llama-family models built from transformers configs, saved to a
temp dir, for tests that use transformers as the oracle. Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
}


def build_hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    config_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    # Generation runs to max_new_tokens: no EOS, like ignore_eos on our side.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model: torch.nn.Module, directory: Path) -> str:
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


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
