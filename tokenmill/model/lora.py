"""LoRA adapters: PEFT's files (or llama.cpp's GGUF LoRA files) read into
per-projection weights, and the one place their delta is added to a
projection's output.

An adapter of rank r on a Linear W adds `x @ A.T @ B.T * scale` to `x @ W.T`
(A: [r, in], B: [out, r]; scale = lora_alpha / r, or lora_alpha / sqrt(r) with
rsLoRA). tokenmill's fused projections take the adapters of their parts:
qkv_proj holds q_proj's, k_proj's and v_proj's (each its own rows of the
output), gate_up_proj gate_proj's and up_proj's. Per fused projection the parts'
A are stacked into one [R, in] matrix and their B into one block-diagonal
[out, R] matrix, so a segment of rows costs one shrink GEMM and one expand GEMM
however many parts the adapter targets; `parts` says which outputs and ranks
each part holds (the CPU kernel keeps each part's B apart, without the zeros).

The delta is computed in float32 and added to the base output in float32, then
rounded to the model's dtype: PEFT's order (it keeps adapter weights in float32
and casts x up), whatever the base weight's format (bf16, float32, Q8_0, a
GGUF's blocks: the base projection's output is all the delta sees). The CPU
plan keeps the weights themselves in the model's dtype (vLLM's lora_dtype
"auto"), the sums still float32.

Adapters are never merged into the base weights: a step mixes base rows and
rows of several adapters (`LoRABatch`: each adapter's rows, the segments).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import ModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# The fused projection each target feeds, and which shard of its output rows.
# (None: the whole output: Phi-3's own fused checkpoints name them so.)
TARGETS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    "gate_up_proj": ("gate_up_proj", None), "down_proj": ("down_proj", None),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the file and what to do."""


def projection_shapes(spec: ModelSpec) -> dict[str, tuple[int, dict[str | None, tuple[int, int]]]]:
    """Per fused projection: its input width and each shard's output rows (start, end)."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    inter = spec.intermediate_size
    return {
        "qkv_proj": (spec.hidden_size, {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
                                        None: (0, q + 2 * kv)}),
        "o_proj": (q, {None: (0, spec.hidden_size)}),
        "gate_up_proj": (spec.hidden_size, {"gate": (0, inter), "up": (inter, 2 * inter),
                                            None: (0, 2 * inter)}),
        "down_proj": (inter, {None: (0, spec.hidden_size)}),
    }


@dataclass(frozen=True)
class LoRAWeights:
    """One fused projection's adapter in one layer: every part stacked."""

    a: torch.Tensor  # [R, in] float32: the parts' A, stacked
    b: torch.Tensor  # [out, R] float32: the parts' B, block-diagonal in the output's rows
    scale: torch.Tensor  # [R] float32: each rank's part's scale
    parts: tuple[tuple[int, int, int, int], ...]  # each part's (out_lo, out_hi, rank_lo, rank_hi)


@dataclass(frozen=True)
class LoRAAdapter:
    lora_int_id: int
    lora_name: str
    rank: int  # the largest rank of its parts
    layers: tuple[dict[str, LoRAWeights], ...]  # per layer: projection -> weights

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for w in layer.values()
                   for t in (w.a, w.b, w.scale))


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise LoRAError(f"LoRA adapter {str(directory)!r} has no {ADAPTER_CONFIG}; give a "
                        "directory as PEFT's save_pretrained writes it")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise LoRAError(f"{path} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = [(key, config.get(key)) for key, off in (
        ("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("fan_in_fan_out", False),
    ) if config.get(key, off) not in (off, None, [], False)]
    if config.get("alpha_pattern"):
        refused.append(("alpha_pattern", config["alpha_pattern"]))
    if refused:
        names = ", ".join(f"{k}={v!r}" for k, v in refused)
        raise LoRAError(f"{path}: {names} is not supported (tokenmill serves plain LoRA on "
                        f"{', '.join(TARGETS)}, with lora_alpha or rsLoRA scaling)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise LoRAError(f"{path}: target_modules {unknown} are not modules of this model "
                            f"that tokenmill adapts; the targets it serves are {list(TARGETS)}")
    return config


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise LoRAError(f"LoRA adapter {str(directory)!r} has no {ADAPTER_WEIGHTS}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{path} could not be read as safetensors ({e}); is the file complete?") from e


def _parse_name(name: str, path: Path) -> tuple[int, str, str]:
    """PEFT's tensor name -> (layer, target, "lora_A" | "lora_B"); e.g.
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight."""
    parts = name.split(".")
    try:
        i = parts.index("layers")
        layer = int(parts[i + 1])
        target, which = parts[-3], parts[-2]
    except (ValueError, IndexError):
        raise LoRAError(f"{path}: tensor {name!r} is not a LoRA weight of a decoder layer's "
                        f"projection; tokenmill adapts {list(TARGETS)}") from None
    if which not in ("lora_A", "lora_B") or parts[-1] != "weight":
        raise LoRAError(f"{path}: tensor {name!r} is not a LoRA A or B weight (embedding or "
                        "DoRA adapters are not supported)")
    if target not in TARGETS:
        raise LoRAError(f"{path}: tensor {name!r} adapts {target!r}, which this model lacks "
                        f"(or tokenmill does not adapt); the targets it serves are {list(TARGETS)}")
    return layer, target, which


# A GGUF LoRA's tensors: llama.cpp's name of the base weight + ".lora_a" / ".lora_b".
_GGUF_SUFFIXES = {".lora_a": "lora_A", ".lora_b": "lora_B"}
# A part of one adapter before it is stacked: (layer, target) -> lora_A / lora_B.
Pairs = dict[tuple[int, str], dict[str, torch.Tensor]]


def _peft_pairs(directory: Path) -> tuple[Pairs, Path, Any, bool]:
    """A PEFT directory's A/B pairs, its weights file, lora_alpha and use_rslora."""
    config = _read_config(directory)
    weights = _read_tensors(directory)
    path = directory / ADAPTER_WEIGHTS
    pairs: Pairs = {}
    for name, tensor in weights.items():
        layer, target, which = _parse_name(name, path)
        pairs.setdefault((layer, target), {})[which] = tensor
    return pairs, path, config.get("lora_alpha", config.get("r", 8)), bool(config.get("use_rslora", False))


def _gguf_pairs(path: Path, spec: ModelSpec) -> tuple[Pairs, float | None]:
    """A GGUF LoRA file's A/B pairs (as llama.cpp's convert_lora_to_gguf.py writes
    them: general.type "adapter", adapter.type "lora", adapter.lora.alpha, tensors
    named after the base weight) and its alpha (None: llama.cpp's scale 1). The
    converter permuted lora_B's q/k rows as it permutes the base's: undone here."""
    from tokenmill.model.gguf_families import gguf_family
    from tokenmill.model.gguf_file import GGUFFile, GGUFFormatError
    from tokenmill.model.gguf_tensors import dequantize_gguf_tensor, unpermute_rope_rows

    try:
        reader = GGUFFile(str(path))
    except (GGUFFormatError, OSError) as e:
        raise LoRAError(f"LoRA adapter {str(path)!r} could not be read as GGUF ({e})") from e
    fields = reader.fields
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise LoRAError(f"{path} is a GGUF file but not a LoRA adapter (general.type "
                        f"{fields.get('general.type')!r}, adapter.type {fields.get('adapter.type')!r}); "
                        "convert the adapter with llama.cpp's convert_lora_to_gguf.py")
    try:
        family = gguf_family(fields.get("general.architecture"), str(path))
    except ValueError as e:
        raise LoRAError(str(e)) from e
    if family.architecture != spec.architecture:
        raise LoRAError(f"{path} adapts a {family.architecture} model; this model is "
                        f"{spec.architecture}: the adapter was trained for another model")
    heads = {"q_proj": spec.num_heads, "k_proj": spec.num_kv_heads} if family.permuted_qk else {}
    pairs: Pairs = {}
    for tensor in reader.tensors:
        stem, dot, suffix = tensor.name.rpartition(".")
        which = _GGUF_SUFFIXES.get(dot + suffix)
        if which is None or not stem.endswith(".weight"):
            raise LoRAError(f"{path}: tensor {tensor.name!r} is not a LoRA A or B weight "
                            "(embedding and norm adapters are not supported)")
        layer, target, _ = _parse_name(f"{family.hf_name(stem)[:-len('.weight')]}.{which}.weight", path)
        weight = dequantize_gguf_tensor(tensor)
        if which == "lora_B" and target in heads:
            weight = unpermute_rope_rows(weight, heads[target])
        pairs.setdefault((layer, target), {})[which] = weight
    alpha = fields.get("adapter.lora.alpha")
    return pairs, None if not alpha else float(alpha)


def load_adapter(lora_int_id: int, lora_name: str, lora_path: str, spec: ModelSpec,
                 max_lora_rank: int) -> LoRAAdapter:
    """Read and check an adapter against the model: a PEFT directory, or a GGUF
    LoRA file (scaled as llama.cpp scales it: alpha / rank, or 1 where alpha is
    0; rsLoRA is not recorded in GGUF). LoRAError (saying what is wrong) for
    anything the engine cannot serve."""
    source = Path(lora_path)
    if source.is_file() and source.suffix == ".gguf":
        pairs, gguf_alpha = _gguf_pairs(source, spec)
        path, alpha, rslora = source, gguf_alpha, False
    elif source.is_dir():
        pairs, path, alpha, rslora = _peft_pairs(source)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise LoRAError(f"{source / ADAPTER_CONFIG}: lora_alpha must be a number, got {alpha!r}")
    else:
        raise LoRAError(f"LoRA adapter path {lora_path!r} is not a directory (PEFT's adapter) "
                        "or a .gguf file (llama.cpp's)")
    for layer, target in pairs:
        if not 0 <= layer < spec.num_layers:
            raise LoRAError(f"{path}: {target} of layer {layer} is adapted; the model has "
                            f"{spec.num_layers} layers")
    if not pairs:
        raise LoRAError(f"{path} holds no LoRA weights")
    if spec.rotary_dim is not None and any(t in ("q_proj", "k_proj", "qkv_proj") for _, t in pairs):
        raise LoRAError(f"{path}: adapters of q/k are not supported on a partially rotated model "
                        "(the loader reorders its q/k rows); adapt v, o and the MLP only")
    shapes = projection_shapes(spec)
    parts: dict[tuple[int, str], list[tuple[tuple[int, int], torch.Tensor, torch.Tensor, float]]] = {}
    max_rank = 0
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAError(f"{path}: layer {layer}'s {target} has {sorted(ab)} only; each "
                            "target needs both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        projection, shard = TARGETS[target]
        in_features, shard_rows = shapes[projection]
        lo, hi = shard_rows[shard]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (hi - lo, rank):
            raise LoRAError(
                f"{path}: layer {layer}'s {target} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}; this model needs [r, {in_features}] and [{hi - lo}, r]: "
                "the adapter was trained for another model")
        if rank > max_lora_rank:
            raise LoRAError(f"{path}: layer {layer}'s {target} has rank {rank}, over "
                            f"max_lora_rank={max_lora_rank}; start the engine with "
                            f"--max-lora-rank {rank} or more")
        max_rank = max(max_rank, rank)
        scale = 1.0 if alpha is None else alpha / math.sqrt(rank) if rslora else alpha / rank
        parts.setdefault((layer, projection), []).append(((lo, hi), a.float(), b.float(), scale))
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(spec.num_layers)]
    for (layer, projection), items in parts.items():
        out = shapes[projection][1][None][1]
        total = sum(a.shape[0] for _, a, _, _ in items)
        b_all = torch.zeros(out, total)
        spans = []  # each part's (out_lo, out_hi, rank_lo, rank_hi)
        col = 0
        for (lo, hi), a, b, _ in items:
            b_all[lo:hi, col:col + a.shape[0]] = b
            spans.append((lo, hi, col, col + a.shape[0]))
            col += a.shape[0]
        layers[layer][projection] = LoRAWeights(
            a=torch.cat([a for _, a, _, _ in items]).contiguous(),
            b=b_all,
            scale=torch.cat([torch.full((a.shape[0],), s) for _, a, _, s in items]),
            parts=tuple(spans),
        )
    return LoRAAdapter(lora_int_id, lora_name, max_rank, tuple(layers))


class LoRABatch:
    """One forward's adapters: each adapter of the step with its rows (a
    segment: a slice where its rows are contiguous, else their indices).
    Rows of no adapter are left alone."""

    def __init__(self, segments: list[tuple[slice | torch.Tensor, LoRAAdapter]]) -> None:
        self.segments = segments

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """out [rows, out] (the base projection of x [rows, in]) with each
        segment's delta added: x A^T, scaled per rank, times B^T, in float32."""
        for rows, adapter in self.segments:
            weights = adapter.layers[layer].get(projection)
            if weights is None:
                continue
            xs = x[rows].float()
            h = (xs @ weights.a.T) * weights.scale  # [n, R]
            out[rows] = (out[rows].float() + h @ weights.b.T).to(out.dtype)
        return out
