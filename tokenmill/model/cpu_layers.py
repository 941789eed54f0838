"""The decoder layers on the CPU kernels, with the per-call checks done once.

The modules in llama.py decide at every call which code applies (device,
dtype, layout, whether the packed weight is still fresh): about ten calls a
layer, ~3 ms of Python a step for the default model's 30 layers, a quarter of a
decode step at batch 1 (scripts/decode_step.py). When a whole forward can run
on the C++ kernels (bf16 or float32 on the CPU, the plain Llama layer: no q/k
norm), `CpuLayers` runs the very same kernels in the same order from a list
resolved once, so the results are the same bits (tests/test_model_numerics.py
compares both paths).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch.profiler import record_function

from tokenmill.model import cpu_kernels
from tokenmill.model.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.model.llama import LlamaDecoderLayer, LlamaModel


class _Layer(NamedTuple):
    attn: Any  # LlamaAttention: its backend, scale and sliding window
    norm1: torch.Tensor
    qkv: torch.Tensor  # packed weights, then their output counts and biases
    qkv_n: int
    qkv_bias: torch.Tensor
    o: torch.Tensor
    o_n: int
    o_bias: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    gate_up_n: int
    down: torch.Tensor
    down_n: int


_NO_BIAS = torch.empty(0)


class CpuLayers:
    def __init__(self, model: LlamaModel, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.layers: list[_Layer] = []
        # Every parameter read, where it was found and its version: fresh() sees
        # one replaced or changed in place since.
        self.sources: list[tuple[dict[str, Any], str, torch.Tensor, int]] = []
        self._watch(model.norm)
        for layer in cast("list[LlamaDecoderLayer]", list(model.layers)):
            a, mlp = layer.self_attn, layer.mlp
            packed: list[torch.Tensor] = []
            for lin in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
                weight = lin.packed_weight()
                if weight is None:
                    raise ValueError("a projection has no packed weight")
                packed.append(weight)
            self.layers.append(_Layer(
                a, layer.input_layernorm.weight,
                packed[0], a.qkv_proj.out_features, _bias(a.qkv_proj.bias),
                packed[1], a.o_proj.out_features, _bias(a.o_proj.bias),
                layer.post_attention_layernorm.weight,
                packed[2], mlp.gate_up_proj.out_features, packed[3], mlp.down_proj.out_features,
            ))
            for module in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj,
                           layer.input_layernorm, layer.post_attention_layernorm):
                self._watch(module)
        self.one_backend = len({id(layer.attn.backend) for layer in self.layers}) <= 1
        self.final_norm = model.norm.weight
        self.eps = model.norm.eps
        self.rotary = model.rotary_emb
        from tokenmill.model.llama import PACKED_MAX_ROWS  # llama imports this module

        self.max_rows = PACKED_MAX_ROWS  # more rows go to torch's matmul (the modules' code)

    def _watch(self, module: torch.nn.Module) -> None:
        for name, param in module._parameters.items():
            if param is not None:
                self.sources.append((module._parameters, name, param, param._version))

    @classmethod
    def build(cls, model: LlamaModel, dtype: torch.dtype) -> CpuLayers | None:
        """The plan for `model` in `dtype`, or None where some layer needs the modules' code."""
        if dtype not in (torch.bfloat16, torch.float32) or cpu_kernels.fused_ops(
            torch.empty(1, 2, dtype=dtype)
        ) is None or cpu_kernels.packed_gemm_ops(torch.empty(1, 2, dtype=dtype)) is None:
            return None
        for layer in cast("list[LlamaDecoderLayer]", list(model.layers)):
            a = layer.self_attn
            if a.q_norm is not None or any(p.device.type != "cpu" or p.dtype != dtype
                                           for p in layer.parameters()):
                return None
        try:
            return cls(model, dtype)
        except ValueError:
            return None

    def fresh(self) -> bool:
        """No parameter replaced or changed in place since the plan was made
        (its packed copies would be stale)."""
        return all(params[name] is w and w._version == v for params, name, w, v in self.sources)

    def applies(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this forward fits the kernels (LlamaModel has checked that they are loaded)."""
        return (hidden.dtype == self.dtype and hidden.device.type == "cpu"
                and hidden.shape[0] <= self.max_rows
                and all(c.dtype == self.dtype for c in kv_caches))

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the embeddings
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm
        ops: Any = cpu_kernels.load()
        gemm = ops.packed_gemm
        profiling = torch.autograd._profiler_enabled()
        if profiling:  # the same rows as the modules' code in `bench throughput --profile`
            def gemm(*args: Any) -> torch.Tensor:
                with record_function("tokenmill::linear"):
                    return ops.packed_gemm(*args)
        cos, sin = self.rotary.cos_cache, self.rotary.sin_cache
        eps, n = self.eps, hidden.shape[0]
        residual = hidden
        call = None  # the attention kernel's arguments: the same for every layer of a step
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            a = layer.attn
            # HF's h = h + attn(norm(h)); h = h + mlp(norm(h)); each residual add
            # done with the norm after it, in place, as LlamaDecoderLayer does.
            if i == 0:
                x = ops.rms_norm(hidden, layer.norm1, eps)
            else:
                ops.fused_add_rms_norm(hidden, residual, layer.norm1, eps)
                x = hidden
            qkv = gemm(x, layer.qkv, layer.qkv_n, layer.qkv_bias, False)
            ops.rope_qkv_cache(qkv, a.num_heads, a.num_kv_heads, a.head_dim, positions, cos, sin,
                               kv_cache, meta.slot_mapping)
            q = qkv[:, : a.q_size].view(n, a.num_heads, a.head_dim)
            if i == 0 and self.one_backend and hasattr(a.backend, "kernel_call"):
                call = a.backend.kernel_call(q, kv_cache, meta)
            with record_function("tokenmill::attention") if profiling else nullcontext():
                if call is not None:
                    kernel, tables, seq_lens, rows = call
                    out = kernel(q, kv_cache, tables, seq_lens, a.scale, a.sliding_window or 0, rows)
                else:
                    out = a.backend.attend(q, kv_cache, meta, a.scale, a.sliding_window)
            hidden = gemm(out.reshape(n, a.q_size), layer.o, layer.o_n, layer.o_bias, False)
            ops.fused_add_rms_norm(hidden, residual, layer.norm2, eps)
            gate_up = gemm(hidden, layer.gate_up, layer.gate_up_n, _NO_BIAS, False)
            hidden = gemm(ops.silu_and_mul(gate_up), layer.down, layer.down_n, _NO_BIAS, False)
        if not self.layers:
            return ops.rms_norm(hidden, self.final_norm, eps)
        ops.fused_add_rms_norm(hidden, residual, self.final_norm, eps)
        return hidden


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return _NO_BIAS if bias is None else bias
