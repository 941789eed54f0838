"""Experts' checkpoint tensors under the names model/llama.py's SparseMoeBlock has.

Its parameters are one module per expert (`mlp.experts.E.gate_up_proj`,
`mlp.experts.E.down_proj`) and the router (`mlp.gate`), so the quantized
formats and the CPU plan take each expert as any other projection. Checkpoints
hold them in three shapes:
- Qwen3-MoE's Hugging Face files: one tensor per expert and projection
  (`mlp.experts.E.gate_proj.weight`), already our names (the loader fuses gate
  and up as for a dense MLP);
- Mixtral's: `block_sparse_moe.gate`, `block_sparse_moe.experts.E.w1 / w3 / w2`
  (gate / up / down), renamed here;
- stacked, all experts in one tensor [E, out, in]: llama.cpp's `ffn_gate_exps`
  / `ffn_up_exps` / `ffn_down_exps` (the GGUF row names them
  `mlp.experts.gate_proj` ...), and transformers 5's in-memory names
  (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`), split here
  into a tensor per expert, each a slice of the stacked one read once;
- gpt-oss's: the router `mlp.router` (renamed `mlp.gate`), and its experts
  stacked transposed, [E, in, out], with biases, gate and up interleaved
  (`gate_up_proj` [E, H, 2I]: gate in the even columns, up in the odd); or, as
  OpenAI ships it, in MXFP4 (`gate_up_proj_blocks` [E, 2I, H / 32, 16] bytes of
  two 4-bit E2M1 values, the low nibble first, and `gate_up_proj_scales`
  [E, 2I, H / 32], an E8M0 exponent per 32 values), dequantized here to the
  stacked float layout (exact: every value is a small float times a power of 2).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tokenmill.config import ModelSpec
from tokenmill.model.gguf_tensors import WeightLoadError

_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight$")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_proj|up_proj|down_proj|gate_up_proj)(\.weight|\.bias)?$")
_GPT_OSS_ROUTER = re.compile(r"^(model\.layers\.\d+\.mlp\.)router\.(weight|bias)$")
_GPT_OSS_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$")
_GPT_OSS_MXFP4 = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")
# E2M1: the 16 values of a 4-bit MXFP4 code (sign, 2 exponent bits, 1 mantissa bit).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 [..., G, 16] bytes and [..., G] E8M0 exponents -> float32 [..., G * 32]:
    value 2k of a block is byte k's low nibble, 2k + 1 its high one, each times 2^(scale - 127)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise WeightLoadError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                              "(blocks [..., G, 16], scales [..., G])")
    table = torch.tensor(_E2M1, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1).flatten(-2)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).flatten(-2)


def stacked_shape(name: str, spec: ModelSpec) -> tuple[int, ...] | None:
    """The shape [experts, out, in] a stacked experts tensor must have, or None
    where `name` is not one."""
    match = _STACKED.match(name)
    if match is None or not spec.num_experts:
        return None
    width, hidden, experts = spec.moe_intermediate_size, spec.hidden_size, spec.num_experts
    shape = {"gate_proj": (experts, width, hidden), "up_proj": (experts, width, hidden),
             "gate_up_proj": (experts, 2 * width, hidden), "down_proj": (experts, hidden, width)}[match.group(2)]
    return shape[:2] if match.group(3) == ".bias" else shape  # (a bias: [E, out])


def expert_names(tensors: Mapping[str, Callable[[], Any]], storage: Mapping[str, str],
                 spec: ModelSpec) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """`tensors` (name -> loader) and `storage` (name -> GGUF type) with Mixtral's
    names renamed and stacked experts split into one tensor per expert."""
    out: dict[str, Callable[[], Any]] = {}
    kinds: dict[str, str] = {}
    mxfp4: dict[str, dict[str, Callable[[], Any]]] = {}  # a gpt-oss projection -> its blocks' and scales' loaders
    for name, load in tensors.items():
        packed = _GPT_OSS_MXFP4.match(name) if spec.moe_bias else None
        if packed is not None:
            mxfp4.setdefault(packed.group(1), {})[packed.group(2)] = load
            continue
        mixtral = _MIXTRAL.match(name)
        stacked = _STACKED.match(name)
        if spec.moe_bias and (_GPT_OSS_ROUTER.match(name) or _GPT_OSS_EXPERTS.match(name)):
            out.update(_gpt_oss_names(name, load, spec))  # (a gpt-oss directory's layout)
        elif mixtral is not None:
            prefix, part = mixtral.groups()
            head, _, proj = part.rpartition(".")
            renamed = f"{prefix}mlp.{head}.{_MIXTRAL_PARTS[proj]}.weight" if head else f"{prefix}mlp.gate.weight"
            out[renamed] = load
            if name in storage:
                kinds[renamed] = storage[name]
        elif stacked is not None and spec.num_experts:
            shape = stacked_shape(name, spec)
            assert shape is not None
            width = spec.moe_intermediate_size
            # transformers 5's fused [gate; up] as the two checkpoint names the loader fuses
            parts = ({"gate_proj": slice(0, width), "up_proj": slice(width, 2 * width)}
                     if stacked.group(2) == "gate_up_proj" else {stacked.group(2): slice(None)})
            stack = _Stack(name, load, shape, len(parts))
            kind = "bias" if stacked.group(3) == ".bias" else "weight"
            for e in range(spec.num_experts):
                for part, rows in parts.items():
                    expert = f"{stacked.group(1)}{e}.{part}.{kind}"
                    out[expert] = stack.expert_loader(e, rows)
                    if name in storage:
                        kinds[expert] = storage[name]
        else:
            out[name] = load
            if name in storage:
                kinds[name] = storage[name]
    for proj, halves in mxfp4.items():
        if set(halves) != {"blocks", "scales"}:
            raise WeightLoadError(f"{proj}_{'scales' if 'blocks' in halves else 'blocks'} is missing: an MXFP4 "
                                  "tensor needs its blocks and its scales")
        out.update(_gpt_oss_names(proj, _dequantized(halves["blocks"], halves["scales"]), spec))
    return out, kinds


def _dequantized(blocks: Callable[[], Any], scales: Callable[[], Any]) -> Callable[[], torch.Tensor]:
    """A loader of an MXFP4 projection [E, out, in] as gpt-oss's float layout [E, in, out]."""
    def load() -> torch.Tensor:
        return mxfp4_dequantize(torch.as_tensor(blocks()), torch.as_tensor(scales())).transpose(1, 2)
    return load


def _gpt_oss_names(name: str, load: Callable[[], Any], spec: ModelSpec) -> dict[str, Callable[[], Any]]:
    """A gpt-oss directory's router renamed, or its stacked experts split: each expert's
    [in, out] slice transposed, gate_up's even columns (and bias entries) the gate's,
    odd the up's."""
    router = _GPT_OSS_ROUTER.match(name)
    if router is not None:
        return {f"{router.group(1)}gate.{router.group(2)}": load}
    stacked = _GPT_OSS_EXPERTS.match(name)
    assert stacked is not None, name
    experts, width, hidden = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    prefix, proj, bias = stacked.groups()
    kind = "bias" if bias else "weight"
    gate_up = proj == "gate_up_proj"
    shape = ((experts, 2 * width) if gate_up else (experts, hidden)) if bias else (
        (experts, hidden, 2 * width) if gate_up else (experts, width, hidden))
    parts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = (
        {"gate_proj": lambda t: t[..., 0::2], "up_proj": lambda t: t[..., 1::2]} if gate_up
        else {"down_proj": lambda t: t})
    stack = _Stack(name, load, shape, len(parts))
    return {f"{prefix}{e}.{part}.{kind}": stack.expert_loader(e, slice(None), pick, transpose=not bias)
            for e in range(experts) for part, pick in parts.items()}


class _Stack:
    """A stacked experts tensor, read once for all its experts: the first
    expert's read loads it, the last one's drops it."""

    def __init__(self, name: str, load: Callable[[], Any], shape: tuple[int, ...], parts: int) -> None:
        self.name, self.load, self.shape = name, load, shape
        self.value: Any = None
        self.left = shape[0] * parts  # reads before it is dropped

    def expert_loader(self, e: int, rows: slice, pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      transpose: bool = False) -> Callable[[], Any]:
        """Expert e's `rows`; with `pick` (gpt-oss: a float [E, ...] tensor) its slice
        of columns, transposed to [out, in] where `transpose`."""
        if pick is None:
            return lambda: self.take(e, rows)

        def picked() -> torch.Tensor:
            value = self._next()
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != self.shape:
                raise WeightLoadError(f"tensor {self.name} has shape {list(getattr(value, 'shape', []))}, "
                                      f"expected {list(self.shape)}")
            part = pick(value[e])
            return part.T if transpose else part

        return picked

    def _next(self) -> Any:
        if self.value is None:
            self.value = self.load()
        value = self.value
        self.left -= 1
        if self.left == 0:
            self.value = None
        return value

    def take(self, e: int, rows: slice) -> Any:
        value = self._next()
        if isinstance(value, tuple):  # (Q8_0 q, d) with the experts' rows one after the other
            return tuple(self._rows(part, e)[rows] for part in value)
        if isinstance(value, torch.Tensor):
            return self._rows(value, e)[rows]
        # a GGUF type's own blocks (loader.GgufBlocks): rows [E * out, blocks, bytes]
        return type(value)(value.type, self._rows(value.blocks, e)[rows])

    def _rows(self, value: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's rows of the stacked value ([E, out, in], or its rows flattened)."""
        experts, rows = self.shape[0], self.shape[1]
        if value.dim() == len(self.shape) and value.shape[:2] == (experts, rows):  # ([E, out] biases too)
            return value[e]
        if value.shape[0] != experts * rows:
            raise WeightLoadError(f"tensor {self.name} has shape {list(value.shape)}, expected "
                                  f"{list(self.shape)} ({experts} experts of {rows} rows)")
        return value[e * rows:(e + 1) * rows]
