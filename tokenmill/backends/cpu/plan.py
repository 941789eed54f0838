"""The CPU plan: a loaded model's forward and logits on the C++ kernels, with
every per-call check done once, when the runner builds it.

It serves the plain Llama layer (no q/k norm) in bf16 or float32 on the CPU
and runs the reference model's operations in its order on fused kernels
(tests/test_model_numerics.py compares the two on the same inputs). Each
forward takes one of the paths that dispatch.choose_path names (the split
stack, the C++ layer loop, a shard's C++ loop over shared memory, the Python
loop below), decided from the step's metadata alone; the same bits each
(every kernel computes a row alone).

The MLP's activation comes out of the gate_up GEMM's tiles (packed_gemm_silu),
and with `output_rows` (the rows the runner samples) the last layer runs past
its K/V write for those rows only.

A tensor-parallel shard (model/parallel.py: o_proj and down_proj row-parallel)
all-reduces after each of those two GEMMs (their float32 sums, rounded after
the reduce): in the C++ loop over its group's shared memory (layer_loop_tp),
or between the Python loop's kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.attention import CpuAttentionBackend
from tokenmill.backends.cpu.dispatch import SPLIT_ROWS_PER_WEIGHT_BYTE, Path, PathFacts, choose_path
from tokenmill.backends.cpu.kernels import CpuOps
from tokenmill.backends.cpu.memory import pack_q4_1, pack_q8_0, pack_weight
from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.llama import Linear, LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.model.parallel import AllReduce, RowParallelLinear
from tokenmill.model.quantization import is_quantized, q4_1_of, q8_0_of

logger = logging.getLogger("tokenmill")

_NO_BIAS = torch.empty(0)
_NO_ROWS = torch.empty(0, dtype=torch.int64)


class _Proj(NamedTuple):
    """A projection: its packed weight for packed_gemm, and the original for torch's matmul."""

    packed: torch.Tensor  # uint8: Q8_0 / Q4_1 blocks (memory.pack_q8_0 / pack_q4_1), which packed_gemm takes too
    n: int  # output features
    bias: torch.Tensor  # empty: none
    weight: torch.Tensor  # empty where quantized: `ref` then
    ref: Linear | None = None  # a quantized projection's module (its dequantizing forward)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.ref is not None:
            return self.ref(x)
        return F.linear(x, self.weight, self.bias if self.bias.numel() else None)


class _Layer(NamedTuple):
    norm1: torch.Tensor
    qkv: _Proj
    o: _Proj
    norm2: torch.Tensor
    gate_up: _Proj
    down: _Proj
    scale: float
    sliding_window: int | None


def _proj(lin: Linear) -> _Proj:
    bias = _NO_BIAS if lin.bias is None else lin.bias.detach()
    q8, q4 = q8_0_of(lin), q4_1_of(lin)
    if q8 is not None:  # kept quantized: no float copy of the weight at all
        return _Proj(pack_q8_0(*q8), lin.out_features, bias, _NO_BIAS, lin)
    if q4 is not None:
        return _Proj(pack_q4_1(q4), lin.out_features, bias, _NO_BIAS, lin)
    weight = lin.weight.detach()
    return _Proj(pack_weight(weight), lin.out_features, bias, weight)


def unsupported(model: LlamaForCausalLM, dtype: torch.dtype, options: CpuBackendOptions) -> str | None:
    """Why the plan cannot serve `model` in `dtype`, or None where it can."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{str(dtype).removeprefix('torch.')} (the C++ kernels run bfloat16 and float32)"
    probe = torch.empty(1, 2, dtype=dtype)
    reason = kernels.disabled_reason(options.cpp_kernels)
    if reason is not None:
        return reason
    if kernels.fused_ops(probe) is None or kernels.packed_gemm_ops(probe) is None:
        return f"this build of the C++ kernels has no {str(dtype).removeprefix('torch.')} GEMM"
    if any(p.device.type != "cpu" or p.dtype != dtype for p in model.parameters()):
        return "the weights are not all on the CPU in that dtype"
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        if layer.self_attn.q_norm is not None:
            return "q/k norms (the plan runs the plain Llama layer)"
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            if dtype == torch.bfloat16 and lin.in_features % 2:
                return "a projection with an odd number of inputs (packed bf16 takes pairs)"
    if dtype == torch.bfloat16 and model.lm_head.in_features % 2:
        return "a head with an odd number of inputs (packed bf16 takes pairs)"
    return None


class CpuPlan:
    """Serves `forward` and `compute_logits` of the model it was built from
    (LlamaForCausalLM's signatures), on the C++ kernels."""

    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype, ops: CpuOps,
                 options: CpuBackendOptions) -> None:
        self.model = model
        self.options = options
        self.dtype = dtype
        self.ops = ops
        self.attention = CpuAttentionBackend()
        spec = model.spec
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.eps = float(spec.rms_norm_eps)
        self.rotary = model.model.rotary_emb
        self.max_rows = int(ops.packed_gemm_max_rows())  # more rows go to torch's matmul
        self.quantized = is_quantized(model.lm_head)  # (the loader quantizes all or none)
        if self.quantized:  # q8_gemm / q4_gemm serve any number of rows (torch would dequantize every call)
            self.max_rows = 1 << 62
        self.sources: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        self.layers: list[_Layer] = []
        self.all_reduce: AllReduce | None = None  # a tensor-parallel shard's (set by _pack)
        self.last_path: Path | None = None  # the path of the last forward (logged when it changes)
        self._pack()

    @classmethod
    def build(cls, model: LlamaForCausalLM, dtype: torch.dtype,
              options: CpuBackendOptions | None = None) -> CpuPlan | None:
        """The plan for `model` in `dtype`, or None where `unsupported` says why not."""
        options = options or CpuBackendOptions.from_env()
        ops = kernels.load() if options.cpp_kernels else None
        if ops is None or unsupported(model, dtype, options) is not None:
            return None
        return cls(model, dtype, ops, options)

    def _pack(self) -> None:
        """Read (and pack) every weight the plan uses; `sources` remembers each
        parameter and Q8_0 block tensor, and `watch` their versions, for fresh()."""
        self.sources = []
        self.layers = []
        model = self.model.model
        for layer in model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            a, mlp = layer.self_attn, layer.mlp
            if isinstance(a.o_proj, RowParallelLinear):  # (down_proj then too: shard_model)
                self.all_reduce = a.o_proj.all_reduce
            self.layers.append(_Layer(
                layer.input_layernorm.weight.detach(), _proj(a.qkv_proj), _proj(a.o_proj),
                layer.post_attention_layernorm.weight.detach(), _proj(mlp.gate_up_proj),
                _proj(mlp.down_proj), float(a.scale), a.sliding_window,
            ))
            for module in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj,
                           layer.input_layernorm, layer.post_attention_layernorm):
                self._watch(module)
        for other in (model.embed_tokens, model.norm, self.model.lm_head):
            self._watch(other)
        self.watch = self.ops.WeightWatch([d for d, _, _ in self.sources], [n for _, n, _ in self.sources],
                                          [t for _, _, t in self.sources])
        # A Q8_0 embedding's rows come from q8_embed (the same bits as embed_rows).
        embed = model.embed_tokens
        self.embed_q8 = q8_0_of(embed)
        if self.embed_q8 is not None and not all(t.is_contiguous() for t in self.embed_q8):
            self.embed_q8 = None
        self.embed_f32 = getattr(embed, "compute_dtype", self.dtype) == torch.float32
        self.final_norm = model.norm.weight.detach()
        self.head = _proj(self.model.lm_head)
        # The same for the C++ layer calls (csrc/layer_loop.cpp, layer_stack.cpp), by name (csrc/layer_stack.h).
        self.weights = self.ops.ModelWeights(
            layers=[self.ops.LayerWeights(
                norm1=lay.norm1, qkv=lay.qkv.packed, qkv_bias=lay.qkv.bias, o=lay.o.packed,
                o_bias=lay.o.bias, norm2=lay.norm2, gate_up=lay.gate_up.packed,
                down=lay.down.packed, qkv_n=lay.qkv.n, o_n=lay.o.n, gate_up_n=lay.gate_up.n,
                down_n=lay.down.n, sliding_window=lay.sliding_window or 0, scale=lay.scale,
            ) for lay in self.layers],
            final_norm=self.final_norm, eps=self.eps, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            cos=self.rotary.cos_cache, sin=self.rotary.sin_cache,
        )
        # A query row through a layer's projections (2 FLOPs a parameter at ~200
        # GFLOP/s a thread) against attention reading one context token's K and
        # V (at ~10 GB/s a thread): what split_bounds weighs a row against its context.
        self.row_cost = 0.0
        if self.layers:
            first = self.layers[0]
            params = sum(p.packed.numel() for p in (first.qkv, first.o, first.gate_up, first.down))
            kv_bytes = 2 * self.num_kv_heads * self.head_dim * first.qkv.packed.element_size()
            self.row_cost = params / (10.0 * kv_bytes)
        self.path_facts = PathFacts(
            has_layers=bool(self.layers), shard=self.all_reduce is not None,
            tp_layer_loop=self.options.tp_layer_loop, max_rows=self.max_rows, row_cost=self.row_cost,
            split_min_rows=SPLIT_ROWS_PER_WEIGHT_BYTE * self.dtype.itemsize)

    def _watch(self, module: torch.nn.Module) -> None:
        for name, param in module._parameters.items():
            if param is not None:
                self.sources.append((module._parameters, name, param))
        q8 = q8_0_of(module)
        if q8 is not None:  # (Q8_0 blocks are buffers: model/quantization.py)
            for name, tensor in zip(("qweight", "qscale"), q8, strict=True):
                self.sources.append((module._buffers, name, tensor))
        q4 = q4_1_of(module)
        if q4 is not None:  # (quantization="gguf": Q4_1 blocks, a buffer too)
            self.sources.append((module._buffers, "q4_1", q4))

    def fresh(self) -> bool:
        """No parameter or Q8_0 block replaced or changed in place since the
        weights were packed (the packed copies would be stale; changes through
        `.data` go unseen). One C++ loop (csrc/weight_watch.h): in a step this
        runs with cold caches, where the Python loop cost ~1.5 us an entry."""
        return self.watch.unchanged()

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens or len(output_rows), hidden] after the final norm
        """LlamaForCausalLM.forward: with `output_rows`, the last layer writes
        every token's K/V but takes only those rows on through attention,
        o_proj and the MLP. Each row's numbers are the same bits either way."""
        if not self.fresh():
            self._pack()
        if self.embed_q8 is not None and input_ids.dim() == 1:  # (one C++ op for embed_rows' six)
            hidden = self.ops.q8_embed(*self.embed_q8, input_ids, self.embed_f32)
        else:
            hidden = self.model.model.embed_tokens(input_ids)
        profiling = torch.autograd._profiler_enabled()  # (read once a forward)
        native = getattr(self.all_reduce, "native", None)  # a shard's live shared-memory group, or None
        route = choose_path(meta, self.path_facts, profiling=profiling, all_rows=output_rows is None,
                            threads=threads(), shm_group=native is not None)
        if route.path is not self.last_path:
            logger.debug("CPU plan: %s path (%d rows, %d decodes of %d sequences)", route.path.value,
                         meta.num_tokens, meta.num_decodes, meta.num_reqs)
            self.last_path = route.path
        if route.path is Path.PYTHON:
            return self._python_loop(hidden, positions, kv_caches, meta, output_rows, profiling)
        call = self.attention.kernel_call(hidden, kv_caches[0], meta)
        assert call is not None, "choose_path gave a C++ path: one attention call serves the step"
        # (model, hidden, positions, kv_caches, slot_mapping, tables, seq_lens, seq_ids): every C++ path's first arguments
        step = (self.weights, hidden, positions, kv_caches, meta.slot_mapping, call.tables, call.seq_lens,
                call.seq_ids)
        if route.path is Path.SPLIT:
            assert route.split_bounds is not None
            return self.ops.layer_stack(*step, route.split_bounds)
        rows = _NO_ROWS if output_rows is None else output_rows
        if route.path is Path.LOOP:
            return self.ops.layer_loop(*step, rows, output_rows is None)
        assert native is not None  # Path.TP_LOOP
        try:
            return self.ops.layer_loop_tp(*step, rows, output_rows is None, native)
        except RuntimeError as e:  # a peer gone or stuck: the group's error (its ranks are out of step)
            stopped = getattr(self.all_reduce, "stopped", None)
            raise (stopped(e) if stopped is not None else e) from e

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab] from
        packed_gemm's float32 sums at any number of rows: never rounded to bf16
        (whose steps make near-ties exact ties) and the same whatever the batch."""
        with record_function("tokenmill::head"):
            if kernels.packed_gemm_ops(hidden) is None or (hidden.dtype != self.dtype
                                                           and not self.quantized):
                return self.head.linear(hidden).float()
            return self.ops.packed_gemm(hidden, self.head.packed, self.head.n, _NO_BIAS, True)

    def _python_loop(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                     meta: AttentionMetadata, output_rows: torch.Tensor | None,
                     profiling: bool) -> torch.Tensor:
        ops = self.ops
        n = hidden.shape[0]
        packed = n <= self.path_facts.max_rows

        def linear_row(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            if not profiling:
                return f

            def labelled(*args: Any) -> torch.Tensor:  # the reference's rows in `bench --profile`
                with record_function("tokenmill::linear"):
                    return f(*args)
            return labelled

        def matmul(x: torch.Tensor, p: _Proj) -> torch.Tensor:
            return ops.packed_gemm(x, p.packed, p.n, p.bias, False) if packed else p.linear(x)

        def mlp_act(x: torch.Tensor, p: _Proj) -> torch.Tensor:
            # gate/up on whole blocks of 16 outputs: silu(gate) * up from the GEMM's
            # tiles (the same bits), as layer_stack.cpp decides it.
            if packed and p.n % 32 == 0:
                return ops.packed_gemm_silu(x, p.packed, p.n // 2)
            return ops.silu_and_mul(matmul(x, p))

        all_reduce = self.all_reduce

        def row_parallel(x: torch.Tensor, p: _Proj) -> torch.Tensor:
            # A shard's o/down: float32 partial sums, summed over the ranks, rounded
            # once, as the whole GEMM rounds its one sum (bf16 partials would round twice).
            assert all_reduce is not None
            out = ops.packed_gemm(x, p.packed, p.n, p.bias, True) if packed else p.linear(x).float()
            all_reduce(out)
            return out.to(x.dtype)

        gemm, gemm_act = linear_row(matmul), linear_row(mlp_act)
        gemm_out = gemm if all_reduce is None else linear_row(row_parallel)
        cos, sin = self.rotary.cos_cache, self.rotary.sin_cache
        eps = self.eps
        residual = hidden
        call = None  # the attention kernel's arguments: the same for every layer of a step
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            # HF's h = h + attn(norm(h)); h = h + mlp(norm(h)); each residual add
            # done with the norm after it, in place, as the reference does.
            if i == 0:
                x = ops.rms_norm(hidden, layer.norm1, eps)
            else:
                ops.fused_add_rms_norm(hidden, residual, layer.norm1, eps)
                x = hidden
            qkv = gemm(x, layer.qkv)
            ops.rope_qkv_cache(qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, cos, sin,
                               kv_cache, meta.slot_mapping)
            q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
            if i == 0:
                call = self.attention.kernel_call(q, kv_cache, meta)
            if i == last and output_rows is not None and call is not None:
                # Every K/V is written: the rest of the layer for the rows out only.
                call = call.rows(output_rows)
                q, residual, n = q[output_rows], residual[output_rows], output_rows.numel()
                output_rows = None  # done
            with record_function("tokenmill::attention") if profiling else nullcontext():
                if call is not None:
                    out = self.attention.run(call, q, kv_cache, layer.scale, layer.sliding_window)
                else:
                    out = self.attention.attend(q, kv_cache, meta, layer.scale, layer.sliding_window)
            hidden = gemm_out(out.reshape(n, self.q_size), layer.o)
            ops.fused_add_rms_norm(hidden, residual, layer.norm2, eps)
            hidden = gemm_out(gemm_act(hidden, layer.gate_up), layer.down)
        if output_rows is not None:  # (no attention kernel call: the torch attention ran)
            hidden, residual = hidden[output_rows], residual[output_rows]
        if not self.layers:
            return ops.rms_norm(hidden, self.final_norm, eps)
        ops.fused_add_rms_norm(hidden, residual, self.final_norm, eps)
        return hidden


def threads() -> int:
    """The threads a forward may use (tests set more than a machine has)."""
    return torch.get_num_threads()


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return _NO_BIAS if bias is None else bias
