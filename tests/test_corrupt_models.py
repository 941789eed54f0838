"""Corrupt model files: each is a ValueError naming the field, or a clean load
with unchanged logits; never a silent load of wrong values (issue 40).

The default GGUF is copied once and patched in place (each case restores its
bytes); most cases fail in the metadata or tensor-table checks, before any
weight is read, so only the clean-load cases load the whole model."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_models import build_hf_model, save_hf_model
from tests.test_model_loading import _prefill_logits
from tokenmill.config import ModelConfig
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.loader import load_model
from tokenmill.model.source import ModelSource, resolve_model_source
from tokenmill.tokenizer import Tokenizer

PROMPT = [1, 504, 3458, 282, 4649, 314, 216, 2]
NAN, INF = math.nan, math.inf


class _Locator(GGUFFile):
    """GGUFFile that also records where each metadata value and each tensor
    entry's dims, type and offset lie in the file."""

    def __init__(self, path: str) -> None:
        self._depth = 0
        self._value_positions: list[int] = []
        self.tensor_at: dict[str, dict[str, int]] = {}
        super().__init__(path)
        self.value_at = dict(zip(self.fields, self._value_positions, strict=True))

    def _value(self, vtype: int) -> Any:
        if self._depth == 0:
            self._value_positions.append(self._pos)
        self._depth += 1
        try:
            return super()._value(vtype)
        finally:
            self._depth -= 1

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        info = super()._tensor_info()
        name, shape = info[0], info[1]
        type_at = self._pos - 12
        self.tensor_at[name] = {"dims": type_at - 8 * len(shape), "type": type_at,
                                "offset": type_at + 4}
        return info


@contextmanager
def _patched(path: Path, at: int, data: bytes) -> Iterator[None]:
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(len(data))
        f.seek(at)
        f.write(data)
    try:
        yield
    finally:
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(old)


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, _Locator]:
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    shutil.copyfile(resolve_model_source(None).path, path)
    return path, _Locator(str(path))


def _gguf_source(path: Path) -> ModelSource:
    return ModelSource("gguf", str(path), "m")


def _load_logits(source: ModelSource) -> torch.Tensor:
    model, spec = load_model(ModelConfig(dtype="float32"), source)
    return _prefill_logits(model, [t % spec.vocab_size for t in PROMPT])


@pytest.fixture(scope="module")
def default_logits(default_gguf: tuple[Path, _Locator]) -> torch.Tensor:
    return _load_logits(_gguf_source(default_gguf[0]))


# (metadata key, struct format, new value)
METADATA_CASES = [
    ("llama.attention.layer_norm_rms_epsilon", "<f", v) for v in (NAN, -1.0, INF, 0.0)
] + [
    ("llama.rope.freq_base", "<f", v) for v in (NAN, -1.0, 0.0, INF)
] + [
    ("llama.attention.head_count", "<I", 0),
    ("llama.attention.head_count", "<I", 7),  # 576 is not divisible by 7
    ("llama.attention.head_count_kv", "<I", 0),
    ("llama.attention.head_count_kv", "<I", 2),  # does not divide 9 heads
    ("llama.attention.head_count_kv", "<I", 9),  # divides, but attn_k has 3 heads' rows
    ("llama.embedding_length", "<I", 0),
    ("llama.feed_forward_length", "<I", 0),
    ("llama.block_count", "<I", 0),
    ("llama.context_length", "<I", 0),
    # Absurd sizes, refused before anything is allocated for them (issue 50).
    ("llama.block_count", "<I", 2**31),
    ("llama.block_count", "<I", 31),  # the tensors are of 30 layers
    ("llama.context_length", "<I", 2**32 - 1),
    ("llama.embedding_length", "<I", 2**31),
    ("llama.embedding_length", "<I", 576 * 2**20),  # divisible by the heads, not the tensors
    ("llama.feed_forward_length", "<I", 2**31),
    ("llama.attention.head_count", "<I", 2**31),
    ("llama.vocab_size", "<I", 49153),  # the token list holds 49152
    ("tokenizer.ggml.bos_token_id", "<I", 49152),
    ("tokenizer.ggml.eos_token_id", "<I", 10**6),
    ("tokenizer.ggml.padding_token_id", "<I", 2**31),
]


@pytest.mark.parametrize(("key", "fmt", "value"), METADATA_CASES,
                         ids=[f"{k}={v}" for k, _, v in METADATA_CASES])
def test_gguf_bad_metadata_is_an_error_naming_the_key(
    default_gguf: tuple[Path, _Locator], key: str, fmt: str, value: float
) -> None:
    path, locator = default_gguf
    with _patched(path, locator.value_at[key], struct.pack(fmt, value)), \
            pytest.raises(ValueError) as info:
        load_model(ModelConfig(dtype="float32"), _gguf_source(path))
    assert key in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("key", ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"])
def test_gguf_tokenizer_with_token_id_past_the_vocabulary(
    default_gguf: tuple[Path, _Locator], key: str
) -> None:
    path, locator = default_gguf
    with _patched(path, locator.value_at[key], struct.pack("<I", 49152)), \
            pytest.raises(ValueError, match=re.escape(key)):
        Tokenizer.load(str(path))


Q4_0, Q8_0, F32 = (int(t) for t in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0,
                                     gguf.GGMLQuantizationType.F32))

# (tensor, part of its entry, new little-endian value or a function of the old one, size)
TABLE_CASES: list[tuple[str, str, Any, int]] = [
    ("token_embd.weight", "type", Q4_0, 4),  # Q8_0 -> Q4_0
    ("blk.0.attn_norm.weight", "type", Q4_0, 4),  # F32 -> Q4_0
    ("output_norm.weight", "type", Q4_0, 4),  # the last tensor: F32 -> Q4_0
    ("blk.3.ffn_up.weight", "type", Q8_0, 4),  # Q4_1 -> Q8_0 (larger)
    ("blk.0.attn_norm.weight", "offset", lambda old: old + 1, 8),
    ("blk.5.attn_q.weight", "offset", lambda old: old - 1, 8),
    ("blk.5.attn_q.weight", "offset", lambda old: old + 32, 8),  # aligned, still wrong
    ("output_norm.weight", "offset", lambda old: old + 1, 8),
    ("token_embd.weight", "dims+8", 2**40, 8),  # absurd
    ("token_embd.weight", "dims+8", 2**63, 8),
    ("blk.0.attn_norm.weight", "dims", 0, 8),
    ("blk.0.ffn_down.weight", "dims", 1537, 8),  # not whole Q4_1 blocks
]


def _table_patch(locator: _Locator, path: Path, tensor: str, part: str, new: Any,
                 size: int) -> tuple[int, bytes]:
    base, _, extra = part.partition("+")
    at = locator.tensor_at[tensor][base] + int(extra or 0)
    with open(path, "rb") as f:
        f.seek(at)
        old = int.from_bytes(f.read(size), "little")
    value = new(old) if callable(new) else new
    return at, value.to_bytes(size, "little")


@pytest.mark.parametrize(("tensor", "part", "new", "size"), TABLE_CASES,
                         ids=[f"{t}-{p}-{i}" for i, (t, p, _, _) in enumerate(TABLE_CASES)])
def test_gguf_bad_tensor_table_is_an_error_naming_the_tensor(
    default_gguf: tuple[Path, _Locator], tensor: str, part: str, new: Any, size: int
) -> None:
    path, locator = default_gguf
    at, data = _table_patch(locator, path, tensor, part, new, size)
    with _patched(path, at, data), pytest.raises(ValueError) as info:
        load_model(ModelConfig(dtype="float32"), _gguf_source(path))
    assert tensor in str(info.value) and str(path) in str(info.value)


def test_gguf_swapped_dims_name_the_tensor_and_the_metadata(
    default_gguf: tuple[Path, _Locator]
) -> None:
    # Same element count and byte size: only the shape check can see it.
    path, locator = default_gguf
    dims = locator.tensor_at["blk.0.ffn_down.weight"]["dims"]
    swapped = struct.pack("<QQ", 576, 1536)
    with _patched(path, dims, swapped), pytest.raises(ValueError) as info:
        load_model(ModelConfig(dtype="float32"), _gguf_source(path))
    assert "blk.0.ffn_down.weight" in str(info.value)
    assert "llama.feed_forward_length" in str(info.value)


def test_gguf_harmless_edits_load_with_unchanged_logits(
    default_gguf: tuple[Path, _Locator], default_logits: torch.Tensor
) -> None:
    path, locator = default_gguf
    name_at = locator.value_at["general.name"] + 8  # past the string's length
    eps = locator.fields["llama.attention.layer_norm_rms_epsilon"]
    eps_at = locator.value_at["llama.attention.layer_norm_rms_epsilon"]
    with _patched(path, name_at, b"X"), _patched(path, eps_at, struct.pack("<f", eps)):
        logits = _load_logits(_gguf_source(path))
    assert torch.equal(logits, default_logits)


def _tiny_gguf(path: Path, alignment: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_tensor("a", np.ones(8, dtype=np.float32))
    writer.add_tensor("b", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [0, 48, 2**31 + 1])
def test_gguf_bad_alignment(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / "a.gguf"
    _tiny_gguf(path, 64)
    assert len(GGUFFile(str(path)).tensors) == 2
    at = _Locator(str(path)).value_at["general.alignment"]
    with _patched(path, at, struct.pack("<I", alignment)), \
            pytest.raises(ValueError, match=r"general\.alignment") as info:
        GGUFFile(str(path))
    assert str(path) in str(info.value)


# --- Hugging Face directories -----------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_hf_model(build_hf_model("llama"), tmp_path_factory.mktemp("hf") / "m"))


def _hf_copy(hf_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "m"
    shutil.copytree(hf_dir, copy)
    return copy


def _hf_source(path: Path) -> ModelSource:
    return ModelSource("hf", str(path), "m")


def _edit_config(path: Path, **changes: Any) -> None:
    config_path = path / "config.json"
    cfg = json.loads(config_path.read_text())
    if "rope_theta" in changes and cfg.get("rope_parameters"):  # transformers 5 keeps it there
        cfg["rope_parameters"]["rope_theta"] = changes.pop("rope_theta")
    cfg.update(changes)
    config_path.write_text(json.dumps(cfg))  # NaN and Infinity as JSON's extension writes them


HF_CONFIG_CASES: list[tuple[str, Any]] = [
    ("rms_norm_eps", -1.0), ("rms_norm_eps", NAN), ("rms_norm_eps", 0), ("rms_norm_eps", "1e-6"),
    ("rope_theta", 0), ("rope_theta", -10000.0), ("rope_theta", NAN), ("rope_theta", INF),
] + [
    (key, value)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "num_hidden_layers", "vocab_size", "max_position_embeddings")
    for value in (-4, 0, 2.5, "64", True)
] + [
    ("num_key_value_heads", 3),  # does not divide 4 heads
    ("num_attention_heads", 3),  # 64 is not divisible by 3
    ("head_dim", 15),  # odd
    ("bos_token_id", 256), ("eos_token_id", -1), ("eos_token_id", [2, 1000]),
    # Absurd sizes and shapes, refused before anything is allocated for them (issue 50).
    ("rope_parameters", [1, 2]), ("rope_parameters", "linear"), ("rope_scaling", 2.0),
    ("max_position_embeddings", 2**32 - 1), ("num_hidden_layers", 2**31), ("num_hidden_layers", 3),
]


@pytest.mark.parametrize(("key", "value"), HF_CONFIG_CASES,
                         ids=[f"{k}={v!r}" for k, v in HF_CONFIG_CASES])
def test_hf_bad_config_value_is_an_error_naming_the_field(
    hf_dir: Path, tmp_path: Path, key: str, value: Any
) -> None:
    path = _hf_copy(hf_dir, tmp_path)
    _edit_config(path, **{key: value})
    with pytest.raises(ValueError) as info:
        load_model(ModelConfig(dtype="float32"), _hf_source(path))
    assert key in str(info.value) and "config.json" in str(info.value)


def test_hf_generation_config_eos_past_the_vocabulary(hf_dir: Path, tmp_path: Path) -> None:
    path = _hf_copy(hf_dir, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 256]}))
    with pytest.raises(ValueError, match="eos_token_id") as info:
        load_model(ModelConfig(dtype="float32"), _hf_source(path))
    assert "generation_config.json" in str(info.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"llama"', '{"vocab_size": 256,', "\xff\xfe"])
def test_hf_config_not_a_json_object(hf_dir: Path, tmp_path: Path, text: str) -> None:
    path = _hf_copy(hf_dir, tmp_path)
    (path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(ModelConfig(dtype="float32"), _hf_source(path))


def test_hf_harmless_config_edits_load_with_unchanged_logits(hf_dir: Path, tmp_path: Path) -> None:
    reference = _load_logits(_hf_source(hf_dir))
    path = _hf_copy(hf_dir, tmp_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg["rope_theta"]
    # An int where a float was, and a key nobody reads.
    _edit_config(path, rope_theta=int(theta), some_new_key={"x": 1})
    assert torch.equal(_load_logits(_hf_source(path)), reference)


@pytest.mark.parametrize("change", ["truncated", "missing", "extra", "transposed"])
def test_hf_bad_tensors_name_the_tensor(hf_dir: Path, tmp_path: Path, change: str) -> None:
    path = _hf_copy(hf_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    if change == "truncated":
        tensors[name] = tensors[name][:-1].contiguous()
    elif change == "missing":
        del tensors[name]
    elif change == "extra":
        name = "model.layers.1.self_attn.k_proj.bias"
        tensors[name] = torch.zeros(32)
    else:
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(ModelConfig(dtype="float32"), _hf_source(path))


def _hf_tokenizer_dir(tmp_path: Path) -> Path:
    """A directory with a real (GGUF-derived) tokenizer saved as tokenizer.json."""
    tokenizer = Tokenizer.load(resolve_model_source(None).path)
    path = tmp_path / "tok"
    tokenizer.hf.save_pretrained(path)
    return path


def test_hf_tokenizer_missing_or_corrupt(tmp_path: Path) -> None:
    path = _hf_tokenizer_dir(tmp_path)
    assert Tokenizer.load(str(path)).encode("hello") == Tokenizer.load(
        resolve_model_source(None).path).encode("hello")
    good_config = (path / "tokenizer_config.json").read_text()
    (path / "tokenizer_config.json").write_text("[" + good_config)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.load(str(path))
    (path / "tokenizer_config.json").write_text(good_config)
    good = (path / "tokenizer.json").read_text()
    (path / "tokenizer.json").write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"tokenizer\.json is not valid JSON"):
        Tokenizer.load(str(path))
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        Tokenizer.load(str(path))


def test_hf_hidden_size_not_divisible_by_heads(hf_dir: Path, tmp_path: Path) -> None:
    path = _hf_copy(hf_dir, tmp_path)
    _edit_config(path, head_dim=None, num_attention_heads=6)  # 64 / 6 heads
    with pytest.raises(ValueError, match="hidden_size=64 is not divisible by num_attention_heads=6"):
        load_model(ModelConfig(dtype="float32"), _hf_source(path))
