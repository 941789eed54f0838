"""Weight loading: Hugging Face safetensors directories and GGUF files.

Loading is declarative and strict. Every parameter of the model expects one
checkpoint tensor per shard; the only renames are the fused projections:

    checkpoint name                        our parameter (shard)
    model.layers.N.self_attn.q_proj.W  ->  model.layers.N.self_attn.qkv_proj.W  (q)
    model.layers.N.self_attn.k_proj.W  ->  model.layers.N.self_attn.qkv_proj.W  (k)
    model.layers.N.self_attn.v_proj.W  ->  model.layers.N.self_attn.qkv_proj.W  (v)
    model.layers.N.mlp.gate_proj.W     ->  model.layers.N.mlp.gate_up_proj.W    (gate)
    model.layers.N.mlp.up_proj.W       ->  model.layers.N.mlp.gate_up_proj.W    (up)

(and each expert's, model.layers.N.mlp.experts.E.gate_proj.W, likewise).

A checkpoint tensor that maps to nothing, or a parameter shard no tensor
fills, is an error naming it. GGUF names are first renamed to HF names by
the file's row of model/gguf_families.py (one row per `general.architecture`).
Phi-3's fused qkv_proj and gate_up_proj are split into the names above first,
and with partial rotary its q/k rows reordered (model/fused_checkpoint.py);
experts stacked in one tensor are split per expert and Mixtral's names renamed
(model/moe_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from tokenmill.config import ModelConfig, ModelSpec
from tokenmill.model.bert import EncoderModel
from tokenmill.model.fused_checkpoint import reorder_rotary_rows, split_fused
from tokenmill.model.gguf_families import GGUFFamily, gguf_family
from tokenmill.model.gguf_tensors import (
    WeightLoadError,
    dequantize_gguf_tensor,
    unpermute_rope_rows,
)
from tokenmill.model.llama import Embedding, Linear, LlamaForCausalLM, MergedLinear
from tokenmill.model.moe_checkpoint import expert_names, stacked_shape
from tokenmill.model.quantization import (
    KQUANT_FORMATS,
    Q4_1_BYTES,
    Q8_0_BLOCK,
    dequantize_kquant,
    dequantize_q4_1,
    q4_0_as_q4_1,
    quantize_q8_0,
    set_kquant,
    set_kquant_parts,
    set_q4_1,
    set_q8_0,
)
from tokenmill.model.source import ModelSource
from tokenmill.model.spec import eos_token_ids, spec_from_gguf, spec_from_hf_config
from tokenmill.model.spec_phi3 import GGUF_ROPE_TENSORS, PHI3_ARCHITECTURES

# Checkpoint name fragment -> (our parameter name fragment, shard id).
FUSED_WEIGHTS: Mapping[str, tuple[str, str]] = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    # (a dense MLP's, and each expert's: .mlp.experts.E.gate_proj.)
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}

logger = logging.getLogger("tokenmill")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
M = TypeVar("M", bound=nn.Module)



@dataclasses.dataclass(frozen=True)
class GgufBlocks:
    """A GGUF tensor's blocks as the file has them, of a type quantization="gguf"
    keeps (_KEPT_TYPES): uint8 [out, in / values a block, bytes a block]."""

    type: str  # the GGUF type's name
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.blocks.shape[1] * _block_values(self.type))

    def values(self) -> torch.Tensor:
        """float32 [out, in]: the blocks dequantized (gguf-py's values)."""
        if self.type == "Q4_1":
            return dequantize_q4_1(self.blocks)
        return dequantize_kquant(KQUANT_FORMATS[self.type], self.blocks)

    def as_q4_1(self) -> torch.Tensor:
        """Q4_1 blocks of the same values (Q4_0: m = -8 d)."""
        return self.blocks if self.type == "Q4_1" else q4_0_as_q4_1(self.blocks)


# A checkpoint tensor: float values, or (with quantization="q8_0" / "gguf") a GGUF
# Q8_0 tensor's own blocks as (q int8 [out, in], d float16 [out, in / 32]), or
# (with "gguf") a kept type's blocks.
TensorThunk = Callable[[], "torch.Tensor | tuple[torch.Tensor, torch.Tensor] | GgufBlocks"]
# GGUF types quantization="gguf" keeps as the file has them (model/quantization.py);
# Q4_0 fused with Q4_1 is kept as Q4_1.
_KEPT_TYPES = ("Q4_1", *KQUANT_FORMATS)


def _block_values(type_name: str) -> int:
    return Q8_0_BLOCK if type_name == "Q4_1" else KQUANT_FORMATS[type_name].block_values


def _block_bytes(type_name: str) -> int:
    return Q4_1_BYTES if type_name == "Q4_1" else KQUANT_FORMATS[type_name].block_bytes


def resolve_dtype(
    dtype: str, source: ModelSource, hf_config_dtype: str | None, device: str = "cpu",
    cpu_bf16: bool | None = None,
) -> torch.dtype:
    """The compute dtype. "auto": bfloat16 for GGUF (dequantized weights); for HF
    directories the checkpoint's dtype, except float16 -> bfloat16 on CPU (CPU
    float16 kernels are slow and overflow-prone); float32 if the config is silent.
    On a CPU without bf16 arithmetic (no AVX512-BF16 or AMX: e.g. AMD Zen 3, or
    any AVX2-only x86), "auto" gives float32 instead of bfloat16: there every bf16
    matmul is converted in software, several times slower than float32
    (docs/perf-notes.md). `cpu_bf16`: whether it has them (None: ask torch)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if source.kind == "gguf" or hf_config_dtype in ("float16", "bfloat16"):
        if device.startswith("cuda"):
            return torch.float16 if hf_config_dtype == "float16" else torch.bfloat16
        if cpu_bf16 is None:
            cpu_bf16 = cpu_has_bf16()
        return torch.bfloat16 if cpu_bf16 else torch.float32
    return torch.float32


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (AVX512-BF16 or AMX)."""
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, name, lambda: False)())
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def load_model(
    model_config: ModelConfig, source: ModelSource
) -> tuple[LlamaForCausalLM | EncoderModel, ModelSpec]:
    """Build the model on `model_config.device` and fill every weight from `source`."""
    if model_config.quantization == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization='gguf' runs a GGUF file's own quantized blocks, but "
                         f"{source.path} is a Hugging Face checkpoint; use quantization='q8_0' "
                         "(its weights quantized at load) or None")
    model, spec = _load_gguf(model_config, source) if source.kind == "gguf" else _load_hf(model_config, source)
    _say_longrope_past_original(spec, model_config.max_model_len or spec.max_position_embeddings)
    return model, spec


def _say_longrope_past_original(spec: ModelSpec, max_positions: int) -> None:
    """A LongRoPE model that may run past its original context is told so once
    at load: tokens there rotate as model/rope.py says, not as transformers does."""
    scaling = spec.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings")
    if scaling.get("rope_type") == "longrope" and original is not None and max_positions > original:
        logger.warning(
            "LongRoPE: positions below %d (original_max_position_embeddings) rotate with short_factor, "
            "those from it on with long_factor, each token by its own position; transformers rotates "
            "every token of a sequence longer than %d with long_factor, so outputs past %d tokens can "
            "differ from its (max_model_len=%d; README.md, Models)", original, original, original,
            max_positions)


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """Checkpoint tensor name -> (our parameter name, shard id or None), for every
    tensor the model expects."""
    targets: dict[str, tuple[str, str | None]] = {}
    for param_name, _ in model.named_parameters():
        fused = [
            (ckpt_frag, our_frag, shard)
            for ckpt_frag, (our_frag, shard) in FUSED_WEIGHTS.items()
            if our_frag in param_name
        ]
        for ckpt_frag, our_frag, shard in fused:
            targets[param_name.replace(our_frag, ckpt_frag)] = (param_name, shard)
        if not fused:
            targets[param_name] = (param_name, None)
    return targets


def load_weights(
    model: nn.Module, tensors: Mapping[str, TensorThunk], ignored: Callable[[str], bool],
    quantization: str | None = None, storage: Mapping[str, str] | None = None,
) -> None:
    """Copy each checkpoint tensor (name -> loader) into its parameter or shard.
    Names are checked before any tensor is read. With quantization="q8_0" the
    projections, the embedding and the head are kept as Q8_0 blocks
    (model/quantization.py): a GGUF Q8_0 tensor's own blocks as they are, any
    other tensor quantized here; their float Parameters are never written.
    With "gguf" (`storage`: checkpoint name -> GGUF type) a module whose
    tensors are all of one kept type (Q4_1, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K)
    keeps their blocks as they are (Q4_0 fused with Q4_1: as Q4_1), a fused
    module mixing k-quant types keeps each part's (quantization.set_kquant_parts),
    the others are Q8_0 as above (a fused module mixing other types: Q8_0)."""
    targets = checkpoint_targets(model)
    unexpected = sorted(n for n in tensors if n not in targets and not ignored(n))
    missing = sorted(n for n in targets if n not in tensors)
    if unexpected or missing:
        problems = []
        if missing:
            problems.append(f"missing tensors: {_short_list(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_short_list(unexpected)}")
        raise WeightLoadError(
            f"checkpoint does not match the {type(model).__name__} built from its config; "
            + "; ".join(problems)
        )
    params = dict(model.named_parameters())
    blocks = _q8_0_destinations(model, params, quantization) if quantization is not None else {}
    kept: dict[str, tuple[str, torch.Tensor]] = {}
    kept_parts: dict[str, list[tuple[str, int, torch.Tensor]]] = {}
    if quantization == "gguf":
        kept, kept_parts = _kept_destinations(model, targets, blocks, storage or {})
    with torch.no_grad():
        for name, (param_name, shard) in targets.items():
            dest: torch.Tensor = params[param_name]  # not .data: the copy counts as a change of the weight
            rows = slice(None)
            if shard is not None:
                module = model.get_submodule(param_name.rpartition(".")[0])
                assert isinstance(module, MergedLinear), param_name
                rows = module.shard_slice(shard)
                dest = dest[rows]
            tensor = tensors[name]()
            shape = tuple(tensor[0].shape if isinstance(tensor, tuple) else tensor.shape)
            if shape != tuple(dest.shape):
                raise WeightLoadError(
                    f"tensor {name} has shape {shape}, expected {tuple(dest.shape)}"
                )
            if param_name in kept:
                assert isinstance(tensor, GgufBlocks), name
                kind, dest_blocks = kept[param_name]
                dest_blocks[rows].copy_(tensor.as_q4_1() if kind == "Q4_1" else tensor.blocks)
            elif param_name in kept_parts:  # the part holding this shard's rows
                assert isinstance(tensor, GgufBlocks) and shard is not None, name
                start, stop = rows.start, rows.stop
                for _, first, part in kept_parts[param_name]:
                    if first <= start < first + part.shape[0]:
                        part[start - first:stop - first].copy_(tensor.blocks)
            elif param_name in blocks:
                if isinstance(tensor, GgufBlocks):  # (a fused module mixing types)
                    tensor = tensor.values()
                q, d = tensor if isinstance(tensor, tuple) else quantize_q8_0(tensor)
                blocks[param_name][0][rows].copy_(q)
                blocks[param_name][1][rows].copy_(d)
            else:
                assert isinstance(tensor, torch.Tensor), name
                dest.copy_(tensor)  # casts to the model's dtype and moves to its device
    for param_name, (kind, kept_blocks) in kept.items():
        module = model.get_submodule(param_name.rpartition(".")[0])
        _set_kept(module, kind, kept_blocks)
        if isinstance(module, Embedding):
            module.compute_dtype = params[param_name].dtype
    for param_name, part_list in kept_parts.items():
        set_kquant_parts(model.get_submodule(param_name.rpartition(".")[0]),
                         [(KQUANT_FORMATS[kind], part) for kind, _, part in part_list])
    for param_name, (q, d) in blocks.items():
        module = model.get_submodule(param_name.rpartition(".")[0])
        set_q8_0(module, q, d)
        if isinstance(module, Embedding):
            module.compute_dtype = params[param_name].dtype
    tied = "lm_head.weight" not in blocks and "lm_head.weight" not in kept
    if (blocks or kept) and isinstance(model, LlamaForCausalLM) and tied:
        embed = "model.embed_tokens.weight"  # tied: the head shares the embedding's blocks
        if embed in kept:
            _set_kept(model.lm_head, *kept[embed])
        else:
            set_q8_0(model.lm_head, *blocks[embed])


def _kept_destinations(
    model: nn.Module, targets: Mapping[str, tuple[str, str | None]],
    blocks: dict[str, tuple[torch.Tensor, torch.Tensor]], storage: Mapping[str, str],
) -> tuple[dict[str, tuple[str, torch.Tensor]], dict[str, list[tuple[str, int, torch.Tensor]]]]:
    """quantization="gguf": parameter name -> (GGUF type, its empty blocks) for each
    quantized weight whose checkpoint tensors are all of one kept type, or Q4_0
    and Q4_1 (kept as Q4_1); and parameter name -> its parts (GGUF type, first row,
    empty blocks), a part each run of shards of one type, for a fused weight mixing
    KQUANT_FORMATS types (a Q4_K_M file's Q4_K q/k beside a Q6_K v). Both taken out
    of `blocks`, the Q8_0 destinations."""
    parts: dict[str, list[str]] = {}
    for name, (param_name, _) in targets.items():
        parts.setdefault(param_name, []).append(name)
    out: dict[str, tuple[str, torch.Tensor]] = {}
    mixed: dict[str, list[tuple[str, int, torch.Tensor]]] = {}
    for param_name in list(blocks):
        kinds = {storage.get(name) for name in parts.get(param_name, [])}
        if kinds == {"Q4_0", "Q4_1"}:
            kinds = {"Q4_1"}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind in _KEPT_TYPES:
            rows, k = blocks.pop(param_name)[0].shape
            out[param_name] = (kind, torch.empty(rows, k // _block_values(kind), _block_bytes(kind),
                                                 dtype=torch.uint8))
        elif len(kinds) > 1 and all(t in KQUANT_FORMATS for t in kinds):
            module = model.get_submodule(param_name.rpartition(".")[0])
            assert isinstance(module, MergedLinear), param_name
            shards = sorted(((module.shard_slice(str(targets[name][1])), storage[name]) for name in parts[param_name]),
                            key=lambda shard: shard[0].start)
            runs: list[list[Any]] = []  # [type, first row, end row]
            for rows_of, shard_kind in shards:
                if runs and runs[-1][0] == shard_kind and runs[-1][2] == rows_of.start:
                    runs[-1][2] = rows_of.stop
                else:
                    runs.append([shard_kind, rows_of.start, rows_of.stop])
            k = blocks.pop(param_name)[0].shape[1]
            mixed[param_name] = [(t, first, torch.empty(end - first, k // _block_values(t), _block_bytes(t),
                                                        dtype=torch.uint8)) for t, first, end in runs]
    return out, mixed


def _set_kept(module: nn.Module, kind: str, kept_blocks: torch.Tensor) -> None:
    if kind == "Q4_1":
        set_q4_1(module, kept_blocks)
    else:
        set_kquant(module, KQUANT_FORMATS[kind], kept_blocks)


def _q8_0_destinations(
    model: nn.Module, params: Mapping[str, torch.Tensor], quantization: str | None = "q8_0",
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Parameter name -> empty (q, d) for each weight Q8_0 keeps quantized: every
    Linear's and the Embedding's (norms and biases stay float)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, param in params.items():
        module = model.get_submodule(name.rpartition(".")[0])
        if not name.endswith(".weight") or not isinstance(module, Linear | Embedding):
            continue
        if getattr(module, "keep_float", False):  # a MoE router (llama.Router)
            continue
        rows, k = param.shape
        if k % Q8_0_BLOCK:
            raise ValueError(f"quantization={quantization!r} needs every projection's input size to be a "
                             f"multiple of {Q8_0_BLOCK} (Q8_0 blocks); {name} has {k}")
        out[name] = (torch.empty(rows, k, dtype=torch.int8),
                     torch.empty(rows, k // Q8_0_BLOCK, dtype=torch.float16))
    return out


def _short_list(names: list[str], limit: int = 10) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _as_llama_names(tensors: dict[str, TensorThunk], storage: dict[str, str],
                    spec: ModelSpec) -> tuple[dict[str, TensorThunk], dict[str, str]]:
    """Phi-3's fused tensors split into the Llama layer's names, and with partial
    rotary its q/k rows in the order model/rope.py rotates (model/fused_checkpoint.py);
    experts one tensor each, under the SparseMoeBlock's names (model/moe_checkpoint.py)."""
    if spec.num_experts:
        tensors, storage = expert_names(tensors, storage, spec)
    if spec.architecture in PHI3_ARCHITECTURES:
        tensors, storage = split_fused(tensors, storage, spec)
    if spec.rotary_dim is not None:
        tensors = reorder_rotary_rows(tensors, spec)
    return tensors, storage


def _finish(model: M) -> M:
    model.eval()
    model.requires_grad_(False)
    return model


# --- Hugging Face directories ------------------------------------------------


def _load_hf(model_config: ModelConfig, source: ModelSource) -> tuple[LlamaForCausalLM | EncoderModel, ModelSpec]:
    config_path = os.path.join(source.path, "config.json")
    cfg = _read_json(config_path)
    spec = spec_from_hf_config(cfg, config_path)
    generation_path = os.path.join(source.path, "generation_config.json")
    if os.path.isfile(generation_path):
        eos = _read_json(generation_path).get("eos_token_id")
        if eos is not None:  # generation_config.json's EOS ids take precedence
            spec = dataclasses.replace(
                spec, eos_token_ids=eos_token_ids(eos, spec.vocab_size, generation_path)
            )
    dtype = resolve_dtype(
        model_config.dtype, source, cfg.get("dtype") or cfg.get("torch_dtype"), model_config.device
    )
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        tensors: dict[str, TensorThunk] = {}
        for file in _safetensors_files(source.path):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = _thunk(handle.get_tensor, name)
        if spec.encoder_only:
            return _load_encoder(model_config, spec, tensors, dtype, config_path), spec
        if spec.headless or "embed_tokens.weight" in tensors:
            # Saved without its head (a Qwen3Model, or Qwen3-Embedding's files, whose
            # config says Qwen3ForCausalLM): the decoder's names without "model.".
            # It pools only; the head is tied to the embedding so the plan builds.
            spec = dataclasses.replace(spec, headless=True, tie_word_embeddings=True)
            tensors = {name if name.startswith("model.") else f"model.{name}": thunk
                       for name, thunk in tensors.items()}
        _check_hf_layer_count(tensors, spec.num_layers, config_path)
        tensors, _ = _as_llama_names(tensors, {}, spec)
        _check_hf_expert_count(tensors, spec, config_path)
        model = LlamaForCausalLM(
            spec,
            max_positions=model_config.max_model_len,
            device=model_config.device,
            dtype=dtype,
        )
        load_weights(model, tensors, ignored=_hf_ignored(spec),
                     quantization=model_config.quantization)
    return _finish(model), spec


def _check_hf_layer_count(names: Mapping[str, Any], num_layers: int, path: str,
                          prefix: str = "model.layers.") -> None:
    """num_hidden_layers is the number of layers the checkpoint holds, checked
    before the model is built (an absurd count would build it first)."""
    layers = {name[len(prefix):].split(".")[0] for name in names if name.startswith(prefix)}
    if num_layers != len(layers):
        raise ValueError(
            f"{path}: num_hidden_layers={num_layers} is invalid; the checkpoint's tensors are of "
            f"{len(layers)} layers ({prefix}N)"
        )


def _check_hf_expert_count(names: Mapping[str, Any], spec: ModelSpec, path: str) -> None:
    """A MoE config's expert count is the number of experts its checkpoint holds,
    checked before the model is built (one module each)."""
    if not spec.num_experts:
        return
    experts = {name.split(".mlp.experts.")[1].split(".")[0] for name in names if ".mlp.experts." in name}
    if spec.num_experts != len(experts):
        field = "num_experts" if spec.architecture == "Qwen3MoeForCausalLM" else "num_local_experts"
        raise ValueError(f"{path}: {field}={spec.num_experts} is invalid; the checkpoint's tensors are of "
                         f"{len(experts)} experts (mlp.experts.E)")


# An encoder checkpoint's names that are not the model's weights: buffers some
# versions saved, pretraining heads (BERT's cls.*, RoBERTa's lm_head.*), and the
# pooler of a base model, which sentence-transformers' pooling does not read.
_ENCODER_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.", "lm_head.")


def _load_encoder(model_config: ModelConfig, spec: ModelSpec, tensors: Mapping[str, TensorThunk],
                  dtype: torch.dtype, config_path: str) -> EncoderModel:
    """BERT / XLM-R (model/bert.py): a *ForSequenceClassification's `bert.` /
    `roberta.` prefix stripped, so every checkpoint has the base model's names."""
    if model_config.quantization is not None:
        raise ValueError(f"quantization={model_config.quantization!r} is not supported for "
                         f"{spec.architecture} (an encoder); drop --quantization")
    renamed = {name.removeprefix("bert.").removeprefix("roberta."): thunk
               for name, thunk in tensors.items()}
    _check_hf_layer_count(renamed, spec.num_layers, config_path, "encoder.layer.")
    model = EncoderModel(spec, device=model_config.device, dtype=dtype)

    def ignored(name: str) -> bool:
        return name.startswith(_ENCODER_IGNORED) or (model.pooler is None and name.startswith("pooler."))

    load_weights(model, renamed, ignored=ignored)
    return _finish(model)


def _hf_ignored(spec: ModelSpec) -> Callable[[str], bool]:
    def ignored(name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved this buffer
            return True
        return spec.tie_word_embeddings and name == "lm_head.weight"

    return ignored


def _safetensors_files(path: str) -> list[str]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map: dict[str, str] = _read_json(index_path)["weight_map"]
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise WeightLoadError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json; "
        "only safetensors checkpoints are supported"
    )


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; a ValueError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}")
    return data


def _thunk(get: Callable[[str], torch.Tensor], name: str) -> TensorThunk:
    return lambda: get(name)


# --- GGUF files --------------------------------------------------------------


def _load_gguf(
    model_config: ModelConfig, source: ModelSource
) -> tuple[LlamaForCausalLM, ModelSpec]:
    from tokenmill.model.gguf_file import GGUFFile  # imports the gguf package

    reader = GGUFFile(source.path)
    spec = spec_from_gguf(reader)
    family = gguf_family(reader.fields.get("general.architecture"), reader.path)
    # Every size in the metadata against the tensors, on a model that allocates
    # nothing: an absurd size is an error naming it, not a failed allocation.
    _check_gguf_tensors(reader, LlamaForCausalLM(spec, device="meta"), spec, family)
    dtype = resolve_dtype(model_config.dtype, source, None, model_config.device)
    model = LlamaForCausalLM(
        spec,
        max_positions=model_config.max_model_len,
        device=model_config.device,
        dtype=dtype,
    )
    tensors: dict[str, TensorThunk] = {}
    storage: dict[str, str] = {}
    quantization = model_config.quantization
    # Heads of the rows llama.cpp's converter permuted for its interleaved RoPE, to undo.
    permuted = {".q_proj.": spec.num_heads, ".k_proj.": spec.num_kv_heads} if family.permuted_qk else {}
    for tensor in reader.tensors:
        name = family.hf_name(tensor.name)
        heads = next((n for frag, n in permuted.items() if frag in name), None)
        tensors[name] = _gguf_thunk(tensor, heads, quantization in ("q8_0", "gguf"), quantization == "gguf")
        if family.norm_shift and name.endswith("norm.weight"):
            tensors[name] = _shifted(tensors[name], family.norm_shift)
        storage[name] = tensor.tensor_type.name
    tensors, storage = _as_llama_names(tensors, storage, spec)
    # rope_freqs (Llama 3 RoPE scaling) and rope_factors_* (Phi-3's LongRoPE) are
    # read into the spec by spec_from_gguf.
    load_weights(model, tensors, ignored=lambda name: name == "rope_freqs.weight" or name in GGUF_ROPE_TENSORS,
                 quantization=quantization, storage=storage)
    return _finish(model), spec


_FLOAT_TYPES = ("F32", "F16", "BF16")


def _check_gguf_tensors(reader: Any, model: nn.Module, spec: ModelSpec, family: GGUFFamily) -> None:
    """Each tensor's shape is what the metadata makes it, and norms are floats
    (llama.cpp never quantizes them), checked before any tensor is read so that
    a corrupt table names the tensor and the metadata rather than failing in a
    reshape."""
    params = dict(model.named_parameters())
    targets = checkpoint_targets(model)
    arch = reader.fields.get("general.architecture")
    for tensor in reader.tensors:
        name = family.hf_name(tensor.name)
        actual = tuple(int(d) for d in reversed(tensor.shape))
        stacked = stacked_shape(name, spec)
        if stacked is not None and actual != stacked:
            raise WeightLoadError(
                f"{reader.path}: tensor {tensor.name} has shape {list(actual)}, but the metadata makes it "
                f"{list(stacked)} ({arch}.expert_count={spec.num_experts}, {arch}.embedding_length="
                f"{spec.hidden_size}, {arch}.expert_feed_forward_length={spec.moe_intermediate_size})")
        target = targets.get(name)
        if target is None and name in params:  # a fused tensor (Phi-3's): the whole parameter's rows
            target = (name, None)
        if target is None:
            continue  # unexpected names are reported by load_weights
        param_name, shard = target
        shape: tuple[int, ...] = tuple(params[param_name].shape)
        if shard is not None:
            module = model.get_submodule(param_name.rpartition(".")[0])
            assert isinstance(module, MergedLinear), param_name
            shape = tuple(params[param_name][module.shard_slice(shard)].shape)
        if actual != shape:
            raise WeightLoadError(
                f"{reader.path}: tensor {tensor.name} has shape {list(actual)}, but the metadata "
                f"makes it {list(shape)} ({arch}.embedding_length={spec.hidden_size}, "
                f"{arch}.attention.head_count={spec.num_heads}, "
                f"{arch}.attention.head_count_kv={spec.num_kv_heads}, head size {spec.head_dim}, "
                f"{arch}.feed_forward_length={spec.intermediate_size}, "
                + (f"{arch}.expert_count={spec.num_experts}, " if spec.num_experts else "")
                + f"{spec.vocab_size} tokens)"
            )
        if "norm" in tensor.name and tensor.tensor_type.name not in _FLOAT_TYPES:
            raise WeightLoadError(
                f"{reader.path}: tensor {tensor.name} has type {tensor.tensor_type.name}; a norm "
                f"weight must be one of {', '.join(_FLOAT_TYPES)}"
            )


def _gguf_thunk(
    tensor: Any, rope_heads: int | None, q8_0_blocks: bool = False, kept_blocks: bool = False
) -> TensorThunk:
    def load() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | GgufBlocks:
        kind = tensor.tensor_type.name
        if kept_blocks and kind in _KEPT_TYPES:
            blocks = gguf_blocks(tensor)
            return GgufBlocks(kind, blocks if rope_heads is None else unpermute_rope_rows(blocks, rope_heads))
        if q8_0_blocks and tensor.tensor_type.name == "Q8_0":
            q, d = q8_0_gguf_blocks(tensor)
            if rope_heads is None:
                return q, d
            return unpermute_rope_rows(q, rope_heads), unpermute_rope_rows(d, rope_heads)
        weight = dequantize_gguf_tensor(tensor)
        return weight if rope_heads is None else unpermute_rope_rows(weight, rope_heads)

    return load


def _shifted(load: TensorThunk, shift: float) -> TensorThunk:
    """A norm weight less what llama.cpp's converter added to it (float32, as
    transformers' GGUF loader subtracts it)."""

    def shifted() -> torch.Tensor:
        weight = load()
        assert isinstance(weight, torch.Tensor), "norm weights are float tensors (_check_gguf_tensors)"
        return weight - shift

    return shifted


def q8_0_gguf_blocks(tensor: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 tensor's blocks as they are in the file (34 bytes each: a
    float16 d, then 32 int8 q): (q int8 [out, in], d float16 [out, in / 32])."""
    shape = tuple(int(dim) for dim in reversed(tensor.shape))  # [out, in]
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, k // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
    d = torch.from_numpy(np.ascontiguousarray(raw[:, :, :2]).view(np.float16).reshape(rows, -1))
    q = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(rows, k))
    return q, d


def gguf_blocks(tensor: Any) -> torch.Tensor:
    """A GGUF tensor of a kept type: its blocks as they are in the file
    (model/quantization.py's layouts), uint8 [out, in / values a block, bytes a block],
    read-only: a view of the file's map."""
    kind = tensor.tensor_type.name
    shape = tuple(int(dim) for dim in reversed(tensor.shape))  # [out, in]
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, k // _block_values(kind), _block_bytes(kind))
    # A view of the file's read-only map, not a copy: the loader only reads it, into the
    # module's blocks (one copy of a 4.5 GB 8B file the fewer; torch warns of the read-only map).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


