"""The decoder layers on the CPU kernels, with the per-call checks done once.

The modules in llama.py decide at every call which code applies (device,
dtype, layout, whether the packed weight is still fresh): about ten calls a
layer, ~3 ms of Python a step for the default model's 30 layers, a quarter of a
decode step at batch 1 (scripts/decode_step.py). When a whole forward can run
on the C++ kernels (bf16 or float32 on the CPU, the plain Llama layer: no q/k
norm), `CpuLayers` runs the very same kernels in the same order from a list
resolved once, so the results are the same bits (tests/test_model_numerics.py
compares both paths). Where a step has enough rows to share out (decodes
mostly), the whole stack runs in one C++ call instead, each thread taking its
own requests through every layer (csrc/layer_stack.cpp): the same bits again.
The MLP's activation comes out of the gate_up GEMM's tiles
(packed_gemm_silu), and with `output_rows` (the rows the runner samples) the
last layer runs past its K/V write for those rows only.
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
_NO_ROWS = torch.empty(0, dtype=torch.int64)


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
        # The same, flat, for csrc/layer_stack.cpp: 8 tensors, 5 ints and a scale a layer.
        weights: list[torch.Tensor] = []
        ints: list[int] = []
        for lay in self.layers:
            weights += [lay.norm1, lay.qkv, lay.qkv_bias, lay.o, lay.o_bias, lay.norm2, lay.gate_up,
                        lay.down]
            ints += [lay.qkv_n, lay.o_n, lay.gate_up_n, lay.down_n, lay.attn.sliding_window or 0]
        self.flat = (weights, ints, [float(lay.attn.scale) for lay in self.layers])
        # A query row through a layer's projections (2 FLOPs a parameter at ~200
        # GFLOP/s a thread) against attention reading one context token's K and
        # V (at ~10 GB/s a thread, measured): ~460 context tokens for the default model.
        self.row_cost = 0.0
        if self.layers:
            first = self.layers[0]
            params = sum(w.numel() for w in (first.qkv, first.o, first.gate_up, first.down))
            kv_bytes = 2 * first.attn.num_kv_heads * first.attn.head_dim * first.qkv.element_size()
            self.row_cost = params / (10.0 * kv_bytes)
        self.max_rows = cpu_kernels.packed_max_rows()  # more rows go to torch's matmul (the modules' code)

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

    def _stack_args(self, hidden: torch.Tensor, positions: torch.Tensor,
                    kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> list[Any] | None:
        """The arguments csrc/layer_stack.cpp's calls share, where one attention
        kernel call serves every layer of the step; else None."""
        if not self.layers or not self.one_backend:
            return None
        a0 = self.layers[0].attn
        if not hasattr(a0.backend, "kernel_call"):
            return None
        call = a0.backend.kernel_call(hidden, kv_caches[0], meta)  # (checks device and dtype only)
        if call is None:
            return None
        _, tables, seq_lens, rows = call
        weights, ints, scales = self.flat
        return [hidden, positions, weights, ints, scales, kv_caches, self.final_norm, self.eps,
                a0.num_heads, a0.num_kv_heads, a0.head_dim, self.rotary.cos_cache,
                self.rotary.sin_cache, meta.slot_mapping, tables, seq_lens, rows]

    def _split_call(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    meta: AttentionMetadata, ops: Any) -> torch.Tensor | None:
        """The whole stack in one C++ call with the rows split between threads
        (csrc/layer_stack.cpp), where the step divides well; else None."""
        if torch.autograd._profiler_enabled():
            return None  # (under the profiler: the per-op rows of `bench --profile`)
        min_rows = SPLIT_ROWS_PER_WEIGHT_BYTE * self.dtype.itemsize
        bounds = split_bounds(meta, threads(), self.row_cost, min_rows)
        args = None if bounds is None else self._stack_args(hidden, positions, kv_caches, meta)
        return None if args is None else cast("torch.Tensor", ops.layer_stack(*args, bounds))

    def _loop_call(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                   meta: AttentionMetadata, ops: Any, output_rows: torch.Tensor | None,
                   ) -> torch.Tensor | None:
        """The layer loop below in one C++ call (csrc/layer_stack.cpp layer_loop:
        no Python between the kernels, 0.4-1.4 ms a step); else None."""
        args = self._stack_args(hidden, positions, kv_caches, meta)
        if args is None:
            return None
        rows_out = _NO_ROWS if output_rows is None else output_rows
        return cast("torch.Tensor", ops.layer_loop(*args, rows_out, output_rows is None))

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the embeddings
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens or len(output_rows), hidden] after the final norm
        """With `output_rows`, the last layer writes every token's K/V but takes
        only those rows on through attention, o_proj and the MLP (a prefill
        chunk needs one row out of hundreds: ~3% of its FLOPs in a 30-layer
        model). Each row's numbers are the same bits either way: every kernel
        computes a row alone (tests/test_model_numerics.py)."""
        ops: Any = cpu_kernels.load()
        if output_rows is None:  # (the runner asks for all rows where it samples all: decodes)
            split = self._split_call(hidden, positions, kv_caches, meta, ops)
            if split is not None:
                return split
        profiling = torch.autograd._profiler_enabled()
        looped = None if profiling else self._loop_call(hidden, positions, kv_caches, meta, ops,
                                                         output_rows)
        if looped is not None:
            return looped
        gemm, gemm_silu = ops.packed_gemm, ops.packed_gemm_silu
        if profiling:  # the same rows as the modules' code in `bench throughput --profile`
            def gemm(*args: Any) -> torch.Tensor:
                with record_function("tokenmill::linear"):
                    return ops.packed_gemm(*args)

            def gemm_silu(*args: Any) -> torch.Tensor:
                with record_function("tokenmill::linear"):  # (the activation inside: ~2% of it)
                    return ops.packed_gemm_silu(*args)
        cos, sin = self.rotary.cos_cache, self.rotary.sin_cache
        eps, n = self.eps, hidden.shape[0]
        residual = hidden
        call = None  # the attention kernel's arguments: the same for every layer of a step
        last = len(self.layers) - 1
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
            if i == last and output_rows is not None and call is not None:
                # Every K/V is written: the rest of the layer for the rows out only.
                kernel, tables, seq_lens, rows = call  # rows empty: query i reads table row i
                call = (kernel, tables, seq_lens[output_rows],
                        rows[output_rows] if rows.numel() else output_rows)
                q, residual, n = q[output_rows], residual[output_rows], output_rows.numel()
                output_rows = None  # done
            with record_function("tokenmill::attention") if profiling else nullcontext():
                if call is not None:
                    kernel, tables, seq_lens, rows = call
                    out = kernel(q, kv_cache, tables, seq_lens, a.scale, a.sliding_window or 0, rows)
                else:
                    out = a.backend.attend(q, kv_cache, meta, a.scale, a.sliding_window)
            hidden = gemm(out.reshape(n, a.q_size), layer.o, layer.o_n, layer.o_bias, False)
            ops.fused_add_rms_norm(hidden, residual, layer.norm2, eps)
            # gate/up on whole blocks of 16 outputs: silu(gate) * up from the GEMM's
            # tiles (the same bits), as layer_stack.cpp decides it.
            if layer.gate_up_n % 32 == 0:
                act = gemm_silu(hidden, layer.gate_up, layer.gate_up_n // 2)
            else:
                act = ops.silu_and_mul(gemm(hidden, layer.gate_up, layer.gate_up_n, _NO_BIAS, False))
            hidden = gemm(act, layer.down, layer.down_n, _NO_BIAS, False)
        if output_rows is not None:  # (no attention kernel call: the backend's own code ran)
            hidden, residual = hidden[output_rows], residual[output_rows]
        if not self.layers:
            return ops.rms_norm(hidden, self.final_norm, eps)
        ops.fused_add_rms_norm(hidden, residual, self.final_norm, eps)
        return hidden


def threads() -> int:
    """The threads a forward may use (tests set more than a machine has)."""
    return torch.get_num_threads()


# Split the rows between threads only from this many rows a thread for each
# byte of a weight (16 rows in bf16, 32 in float32): a split thread reads all
# of the weights for itself, which pays only once each weight serves enough
# rows. Measured on decode steps at context 264: bf16 on a Zen 4, B=16 25.3 ->
# 27.7 ms split, B=32 41.0 -> 38.1; float32 on a Zen 3 (steps alternating
# split / layer loop in one process, medians of 12-15, ms): B=32 133.4 split
# vs 121.4 loop, B=48 217.6 vs 189.1, B=64 217.7 vs 214.7, B=128 466.9 vs
# 500.1 (the float32 threshold was 16 rows, as bf16's, before); bf16 on the
# Zen 3 (float32 math on bf16 weights, csrc/packed_gemm.cpp), B=48: 155.2 ms
# split vs 162.7 loop (scripts/step_ab.py, medians of 12), so 16 rows there too.
SPLIT_ROWS_PER_WEIGHT_BYTE = 8
SPLIT_MAX_SHARE = 0.6  # no split where one thread would get more than this share of the work


def split_bounds(meta: AttentionMetadata, threads: int, row_cost: float,
                 min_rows: float) -> list[int] | None:
    """Row bounds [0, ..., num_tokens] giving each of `threads` threads whole
    requests of about equal cost (a query row costs `row_cost`, each context
    token it attends to 1), or None where the step does not divide well (fewer
    than `min_rows` rows a thread, one request outweighs the rest) or has
    prefills.

    Decodes only: a prefill may read K/V that another request writes in the
    same step (a prefix-cache hit on a block registered when allocated, as
    kv_cache_manager does), which the layer loop orders (every row's K/V of a
    layer is written before any row attends) and separate threads would not.
    A decode reads only blocks computed in earlier steps, and its own new slot.
    (Prefill steps measured no faster split anyway: 2 x 128 tokens 169.9 ->
    163.7 ms, with 20 decodes 198.8 -> 205.7.)"""
    if (threads < 2 or meta.num_tokens < min_rows * threads
            or meta.num_decodes != meta.num_reqs):
        return None
    costs = [row_cost + seq_len for seq_len in meta.seq_lens]  # one query row each (decodes)
    total = float(sum(costs))
    bounds, shares, acc, last = [0], [], 0.0, 0.0
    for r, c in enumerate(costs):
        if len(bounds) < threads and acc + c / 2 >= total * len(bounds) / threads:
            bounds.append(r)  # decodes only: request r is row r
            shares.append(acc - last)
            last = acc
        acc += c
    bounds.append(len(costs))
    shares.append(acc - last)
    if len(bounds) != threads + 1 or max(shares) > SPLIT_MAX_SHARE * total:
        return None
    return bounds


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return _NO_BIAS if bias is None else bias
