"""The CPU plan: a loaded model's forward and logits on the C++ kernels, with
every per-call check done once, when the runner builds it.

It serves the Llama layer (with Qwen3's per-head q/k norms) and Gemma 2 / 3's (its
(1 + w) norms in float32, sandwich norms, GeGLU, scaled embedding, second RoPE
table and soft-caps) in bf16 or float32 on the CPU
and runs the reference model's operations in its order on fused kernels
(tests/test_model_numerics.py compares the two on the same inputs). Each
forward takes one of the paths that dispatch.choose_path names (the split
stack, the C++ layer loop, a shard's C++ loop over shared memory, the Python
loop below), decided from the step's metadata alone; the same bits each
(every kernel computes a row alone).

Every projection is one `PackedWeight` (formats.py: the format table) and
every GEMM call, at any number of rows, runs from it: the plan holds the only
copy of each weight. Built by the runner (`release=True`), it drops the
modules' own float weights and GGUF blocks as it packs them, layer by layer, so
neither the load's peak nor RSS after it holds a weight twice; the released
modules keep meta tensors of their shapes (their size still counts, a forward
through them fails). Built directly (tests), it leaves the model as it is.

The MLP's SiLU·up comes out of the gate_up GEMM's tiles (packed_gemm_silu; GeGLU
runs gelu_tanh_and_mul on the GEMM's output); a mixture of experts' MLP
(SparseMoeBlock) is one op, moe_mlp (csrc/moe.cpp: the router, the top k, each
expert's GEMMs on its rows), its router and every expert packed as any
projection. With `output_rows` (the rows the runner samples) the last layer
runs past its K/V write for those rows only.

A tensor-parallel shard (model/parallel.py: o_proj and down_proj row-parallel)
all-reduces after each of those two GEMMs (their float32 sums, rounded after
the reduce): in the C++ loop over its group's shared memory (layer_loop_tp),
or between the Python loop's kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple, cast

import torch
from torch import nn
from torch.profiler import record_function

from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.attention import CpuAttentionBackend
from tokenmill.backends.cpu.dispatch import SPLIT_ROWS_PER_WEIGHT_BYTE, Path, PathFacts, choose_path
from tokenmill.backends.cpu.formats import pack_module
from tokenmill.backends.cpu.kernels import CppLoraAdapterWeights, CppPackedWeight, CpuOps
from tokenmill.backends.cpu.options import KV_PREFETCH_MODES, CpuBackendOptions
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
    SparseMoeBlock,
)
from tokenmill.model.lora import PROJECTIONS as LORA_PROJECTIONS
from tokenmill.model.lora import LoRAAdapter, LoRABatch
from tokenmill.model.parallel import AllReduce, RowParallelLinear
from tokenmill.model.quantization import KQUANT_FORMATS, is_kquant_part, q8_0_of

logger = logging.getLogger("tokenmill")

_NO_ROWS = torch.empty(0, dtype=torch.int64)
_MAX_LORA_WEIGHTS = 64  # adapters' packed weights kept before those not in the step are dropped
_NO_NORM = torch.empty(0)  # a layer without q/k norms (the C++ takes an empty tensor for none)


class _Experts(NamedTuple):
    """A sparse MLP (SparseMoeBlock) as moe_mlp takes it."""

    router: CppPackedWeight
    gate_up: list[CppPackedWeight]  # each expert's [gate; up]
    down: list[CppPackedWeight]
    top_k: int
    norm_topk_prob: bool
    topk_then_softmax: bool  # gpt-oss's routing and clamped SwiGLU (csrc/moe.h)
    swiglu_limit: float  # 0: silu(gate) * up
    swiglu_alpha: float


class _Layer(NamedTuple):
    norm1: torch.Tensor
    qkv: CppPackedWeight
    o: CppPackedWeight
    norm2: torch.Tensor
    gate_up: CppPackedWeight | None  # the dense MLP's (None: experts)
    down: CppPackedWeight | None
    q_norm: torch.Tensor  # [head_dim], or empty: no q/k norms
    k_norm: torch.Tensor
    scale: float
    sliding_window: int | None
    attn_out_norm: torch.Tensor  # Gemma's on the attention's output, or empty
    mlp_out_norm: torch.Tensor  # Gemma's on the MLP's output, or empty
    cos: torch.Tensor  # this layer's rotary tables (Gemma 3's sliding layers: their own base)
    sin: torch.Tensor
    logit_softcap: float | None  # Gemma 2's attention soft-cap
    experts: _Experts | None = None  # a sparse MLP's (None: the dense one above)
    sinks: torch.Tensor | None = None  # gpt-oss's attention sinks [num_heads] float32


# The tensors a module holds a weight in (model/quantization.py: a float Parameter, or
# Q8_0 / Q4_1 / KQUANT_FORMATS blocks as buffers, or a fused weight's parts), which the packed copy replaces.
_WEIGHT_NAMES = ("weight", "qweight", "qscale", "q4_1", *(name.lower() for name in KQUANT_FORMATS))


def release_weights(module: nn.Module, keep: tuple[torch.Tensor, ...] = ()) -> None:
    """Drop `module`'s weight tensors (not those in `keep`: shared with a module
    still in use) for meta tensors of the same shape and dtype: the packed copy
    is then the only one; the module still reports its size, and a forward
    through it raises rather than computing on nothing."""
    module.forward = _released_forward  # (an instance attribute: nn.Module.__call__ finds it first)
    for store in (module._parameters, module._buffers):
        for name in [*_WEIGHT_NAMES, *(n for n in store if is_kquant_part(n))]:
            t = store.get(name)
            if t is None or t.device.type == "meta" or any(t is k for k in keep):
                continue
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            if store is module._parameters:
                module._parameters[name] = nn.Parameter(meta, requires_grad=False)
            else:
                module._buffers[name] = meta


def norm_weight(norm: RMSNorm) -> torch.Tensor:
    """A norm's weight as the kernels take it: Gemma's (1 + w) and gpt-oss's w in
    float32 (the kernels then scale in float32 and round once, as those HF
    RMSNorms do), else w."""
    w = norm.weight.detach()
    if norm.unit_offset:
        return (1.0 + w.float()).contiguous()
    return w.float().contiguous() if norm.float32_scale else w.contiguous()


def _released_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError("this module's weights were released to the CPU plan, which holds the only copy "
                       "(run the plan, or load the model again for the reference forward)")


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
    if any(p.device.type == "meta" for p in model.parameters()):
        return "the model's weights were released to another CPU plan (load it again)"
    if any(p.device.type != "cpu" or p.dtype != dtype for p in model.parameters()):
        return "the weights are not all on the CPU in that dtype"
    spec = model.spec
    if spec.hidden_act not in ("silu", "gelu_pytorch_tanh"):
        return f"the MLP activation {spec.hidden_act!r} (the plan runs SiLU and GELU-tanh)"
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        mlps = [layer.mlp] if isinstance(layer.mlp, LlamaMLP) else _experts_of(layer.mlp)
        router = [layer.mlp.gate] if isinstance(layer.mlp, SparseMoeBlock) else []
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *router,
                    *(p for mlp in mlps for p in (mlp.gate_up_proj, mlp.down_proj))):
            if dtype == torch.bfloat16 and lin.in_features % 2:
                return "a projection with an odd number of inputs (packed bf16 takes pairs)"
    if dtype == torch.bfloat16 and model.lm_head.in_features % 2:
        return "a head with an odd number of inputs (packed bf16 takes pairs)"
    return None


class CpuPlan:
    """Serves `forward` and `compute_logits` of the model it was built from
    (LlamaForCausalLM's signatures), on the C++ kernels."""

    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype, ops: CpuOps, options: CpuBackendOptions,
                 release: bool = False) -> None:
        self.model = model
        self.options = options
        self.kv_prefetch = KV_PREFETCH_MODES[options.kv_prefetch]  # (as the C++ layer calls take it)
        self.dtype = dtype
        self.ops = ops
        self.attention = CpuAttentionBackend(batch_invariant=options.batch_invariant)
        spec = model.spec
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.eps = float(spec.rms_norm_eps)
        self.rotary = model.model.rotary_emb
        self.gelu = spec.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SwiGLU
        # Gemma: the embedding's rows times sqrt(hidden) rounded to the dtype, as the reference.
        scale = model.model.embed_scale
        self.embed_scale = None if scale is None else torch.tensor(scale).to(dtype)
        self.final_softcap = spec.final_logit_softcapping
        self.layers: list[_Layer] = []
        self.all_reduce: AllReduce | None = None  # a tensor-parallel shard's (set by _pack)
        self.last_path: Path | None = None  # the path of the last forward (logged when it changes)
        # LoRA adapters as the layer loop takes them, by id: (the adapter, its weights).
        self._lora_weights: dict[int, tuple[LoRAAdapter, CppLoraAdapterWeights]] = {}
        self._pack(release)

    @classmethod
    def build(cls, model: LlamaForCausalLM, dtype: torch.dtype, options: CpuBackendOptions,
              release: bool = False) -> CpuPlan | None:
        """The plan for `model` in `dtype`, or None where `unsupported` says why not.
        `options`: the CPU backend's (built once, by the engine's configuration);
        `release`: the plan keeps the only copy of each weight (module docstring)."""
        ops = kernels.load() if options.cpp_kernels else None
        if ops is None or unsupported(model, dtype, options) is not None:
            return None
        return cls(model, dtype, ops, options, release)

    def _pack(self, release: bool) -> None:
        """Pack every projection the plan uses (formats.py), layer by layer,
        dropping each module's own copy as soon as it is packed where `release`."""
        model = self.model.model
        embed = model.embed_tokens
        lm_head = self.model.lm_head
        table = embed._parameters.get("weight")
        tied = table is not None and lm_head._parameters.get("weight") is table
        # Tensors the embedding still reads (a tied head shares them; a Q8_0 table's rows come from q8_embed).
        embed_tensors = tuple(t for t in (*embed._parameters.values(), *embed._buffers.values()) if t is not None)
        ops = self.ops

        def packed(module: nn.Module, keep: tuple[torch.Tensor, ...] = ()) -> CppPackedWeight:
            weight = pack_module(ops, module)
            if release:
                release_weights(module, keep)
            return weight

        local = model.local_rotary_emb  # Gemma 3's sliding layers' own tables
        for layer in model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            a, mlp = layer.self_attn, layer.mlp
            if isinstance(a.o_proj, RowParallelLinear):  # (down_proj then too: shard_model)
                self.all_reduce = a.o_proj.all_reduce
            q_norm, k_norm = (_NO_NORM, _NO_NORM) if a.q_norm is None or a.k_norm is None else (
                norm_weight(a.q_norm), norm_weight(a.k_norm))
            experts, gate_up, down = None, None, None
            if isinstance(mlp, SparseMoeBlock):  # (each expert packed as any projection)
                expert0 = _experts_of(mlp)[0]  # (gpt-oss's SwiGLU clamp: every expert's)
                experts = _Experts(packed(mlp.gate), [packed(e.gate_up_proj) for e in _experts_of(mlp)],
                                   [packed(e.down_proj) for e in _experts_of(mlp)], mlp.top_k, mlp.norm_topk_prob,
                                   mlp.topk_then_softmax, expert0.limit or 0.0, expert0.alpha)
            else:
                gate_up, down = packed(mlp.gate_up_proj), packed(mlp.down_proj)
            # Gemma's sandwich: post_attention_layernorm on the attention's output, and
            # pre_feedforward_layernorm the one fused with the residual add before the MLP.
            sandwich = layer.sandwich
            rotary = local if layer.local_rope and local is not None else self.rotary
            self.layers.append(_Layer(
                norm_weight(layer.input_layernorm), packed(a.qkv_proj), packed(a.o_proj),
                norm_weight(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                gate_up, down, q_norm, k_norm, float(a.scale), a.sliding_window,
                norm_weight(layer.post_attention_layernorm) if sandwich else _NO_NORM,
                norm_weight(layer.post_feedforward_layernorm) if sandwich else _NO_NORM,
                rotary.cos_cache, rotary.sin_cache, a.logit_softcap, experts,
                None if a.sinks is None else a.sinks.detach().float().contiguous(),
            ))
        # A Q8_0 embedding's rows come from q8_embed (the same bits as embed_rows).
        self.embed_q8 = q8_0_of(embed)
        if self.embed_q8 is not None and not all(t.is_contiguous() for t in self.embed_q8):
            self.embed_q8 = None
        self.embed_f32 = getattr(embed, "compute_dtype", self.dtype) == torch.float32
        self.final_norm = norm_weight(model.norm)
        # A float head tied to the embedding: the embedding's rows are read out of
        # the packed head (the same values), so the table is held once.
        self.embed_from_head = tied and self.embed_q8 is None
        self.head = packed(lm_head, () if self.embed_from_head else embed_tensors)
        if release and self.embed_from_head:
            release_weights(embed)
            embed._parameters["weight"] = lm_head._parameters["weight"]  # (still one tied Parameter)
        # The same for the C++ layer calls (csrc/layer_loop.cpp, layer_stack.cpp), by name (csrc/layer_stack.h).
        self.weights = self.ops.ModelWeights(
            layers=[self.ops.LayerWeights(
                norm1=lay.norm1, qkv=lay.qkv, o=lay.o, norm2=lay.norm2, q_norm=lay.q_norm, k_norm=lay.k_norm,
                sliding_window=lay.sliding_window or 0, scale=lay.scale, attn_out_norm=lay.attn_out_norm,
                mlp_out_norm=lay.mlp_out_norm, cos=_NO_NORM if lay.cos is self.rotary.cos_cache else lay.cos,
                sin=_NO_NORM if lay.sin is self.rotary.sin_cache else lay.sin,
                logit_softcap=lay.logit_softcap or 0.0, sinks=lay.sinks, **_mlp_weights(lay),
            ) for lay in self.layers],
            final_norm=self.final_norm, eps=self.eps, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            cos=self.rotary.cos_cache, sin=self.rotary.sin_cache, prefill_tiles=not self.options.batch_invariant,
            act="gelu_pytorch_tanh" if self.gelu else "silu",
        )
        # A query row through a layer's projections (2 FLOPs a parameter at ~200
        # GFLOP/s a thread) against attention reading one context token's K and
        # V (at ~10 GB/s a thread): what split_bounds weighs a row against its context.
        self.row_cost = 0.0
        if self.layers:
            first = self.layers[0]
            params = _data_numel(first.qkv) + _data_numel(first.o) + _mlp_row_numel(first)
            kv_bytes = 2 * self.num_kv_heads * self.head_dim * first.qkv.data.element_size()
            self.row_cost = params / (10.0 * kv_bytes)
        # A split thread reads the weights its rows need for itself: an expert's serve
        # top_k / E of them, so a sparse model needs E / top_k times the rows a thread.
        sparsity = max((len(lay.experts.gate_up) / lay.experts.top_k for lay in self.layers if lay.experts),
                       default=1.0)
        self.path_facts = PathFacts(
            has_layers=bool(self.layers), shard=self.all_reduce is not None,
            tp_layer_loop=self.options.tp_layer_loop, row_cost=self.row_cost,
            split_min_rows=SPLIT_ROWS_PER_WEIGHT_BYTE * self.dtype.itemsize * sparsity)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows (Gemma's times its scale, as the reference):
        q8_embed for a Q8_0 table (one C++ op for embed_rows' six), the packed
        head's rows where the head is the table (a copy of the same values), else
        the embedding module."""
        if self.embed_q8 is not None and input_ids.dim() == 1:
            rows = self.ops.q8_embed(*self.embed_q8, input_ids, self.embed_f32)
        elif self.embed_from_head:
            rows = head_rows(self.head, input_ids)
        else:
            rows = self.model.model.embed_tokens(input_ids)
        if self.embed_scale is None:
            return rows
        return rows * self.embed_scale.to(rows.dtype)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [num_tokens or len(output_rows), hidden] after the final norm
        """LlamaForCausalLM.forward: with `output_rows`, the last layer writes
        every token's K/V but takes only those rows on through attention,
        o_proj and the MLP. Each row's numbers are the same bits either way.
        `lora`: the step's LoRA adapters, whose deltas are added after each
        projection's kernel (in the C++ layer loop, or the Python loop where
        that cannot serve), every row running to the end."""
        hidden = self.embed(input_ids)
        profiling = torch.autograd._profiler_enabled()  # (read once a forward)
        native = getattr(self.all_reduce, "native", None)  # a shard's live shared-memory group, or None
        route = choose_path(meta, self.path_facts, profiling=profiling, all_rows=output_rows is None,
                            threads=threads(), shm_group=native is not None, lora=lora is not None)
        if route.path is not self.last_path:
            logger.debug("CPU plan: %s path (%d rows, %d decodes of %d sequences)", route.path.value,
                         meta.num_tokens, meta.num_decodes, meta.num_reqs)
            self.last_path = route.path
        if route.path is Path.PYTHON:
            return self._python_loop(hidden, positions, kv_caches, meta, output_rows, profiling, lora)
        call = self.attention.kernel_call(hidden, kv_caches[0], meta)
        assert call is not None, "choose_path gave a C++ path: one attention call serves the step"
        # (model, hidden, positions, kv_caches, slot_mapping, tables, seq_lens, seq_ids, layer_groups):
        # every C++ path's first arguments
        step = (self.weights, hidden, positions, kv_caches, meta.slots_by_group(), call.tables, call.seq_lens,
                call.seq_ids, list(meta.layer_groups or ()))
        if route.path is Path.SPLIT:
            assert route.split_bounds is not None
            adapters, lora_rows = ([], []) if lora is None else self._lora_step(lora)
            return self.ops.layer_stack(*step, route.split_bounds, kv_prefetch=self.kv_prefetch,
                                        lora_adapters=adapters, lora_rows=lora_rows)
        rows = _NO_ROWS if output_rows is None else output_rows
        if route.path is Path.LOOP and lora is not None:
            adapters, lora_rows = self._lora_step(lora)
            out = self.ops.layer_loop(*step, _NO_ROWS, True, kv_prefetch=self.kv_prefetch,
                                      lora_adapters=adapters, lora_rows=lora_rows)
            return out if output_rows is None else out[output_rows]
        if route.path is Path.LOOP:
            return self.ops.layer_loop(*step, rows, output_rows is None, kv_prefetch=self.kv_prefetch)
        assert native is not None  # Path.TP_LOOP
        try:
            return self.ops.layer_loop_tp(*step, rows, output_rows is None, native, kv_prefetch=self.kv_prefetch)
        except RuntimeError as e:  # a peer gone or stuck: the group's error (its ranks are out of step)
            stopped = getattr(self.all_reduce, "stopped", None)
            raise (stopped(e) if stopped is not None else e) from e

    def _lora_step(self, lora: LoRABatch) -> tuple[list[CppLoraAdapterWeights], list[torch.Tensor]]:
        """The step's adapters as layer_loop takes them (each built once, kept
        while it stays loaded) and each one's rows as indices."""
        adapters: list[CppLoraAdapterWeights] = []
        rows: list[torch.Tensor] = []
        for segment, adapter in lora.segments:
            entry = self._lora_weights.get(adapter.lora_int_id)
            if entry is None or entry[0] is not adapter:  # (new, or reloaded under its id)
                entry = (adapter, lora_weights(self.ops, adapter, self.dtype))
                self._lora_weights[adapter.lora_int_id] = entry
            adapters.append(entry[1])
            rows.append(torch.arange(segment.start, segment.stop) if isinstance(segment, slice) else segment)
        if len(self._lora_weights) > _MAX_LORA_WEIGHTS:  # unloaded adapters' go; the step's stay
            step = {adapter.lora_int_id for _, adapter in lora.segments}
            self._lora_weights = {k: v for k, v in self._lora_weights.items() if k in step}
        return adapters, rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab] from
        packed_gemm's float32 sums at any number of rows: never rounded to bf16
        (whose steps make near-ties exact ties) and the same whatever the batch."""
        with record_function("tokenmill::head"):
            logits = self.ops.packed_gemm(hidden.contiguous(), self.head, True)
            cap = self.final_softcap
            if cap is None:
                return logits
            # Gemma 2: capped in the model's dtype, then float32, as the reference rounds it.
            capped = logits.to(self.dtype)
            return (torch.tanh(capped / cap) * cap).float()

    def _python_loop(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                     meta: AttentionMetadata, output_rows: torch.Tensor | None,
                     profiling: bool, lora: LoRABatch | None = None) -> torch.Tensor:
        ops = self.ops
        n = hidden.shape[0]

        def linear_row(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            if not profiling:
                return f

            def labelled(*args: Any) -> torch.Tensor:  # the reference's rows in `bench --profile`
                with record_function("tokenmill::linear"):
                    return f(*args)
            return labelled

        def matmul(x: torch.Tensor, p: CppPackedWeight) -> torch.Tensor:
            return ops.packed_gemm(x, p, False)

        def act_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
            return ops.gelu_tanh_and_mul(gate_up) if self.gelu else ops.silu_and_mul(gate_up)

        def mlp_act(x: torch.Tensor, p: CppPackedWeight) -> torch.Tensor:
            # gate/up on whole blocks of 16 outputs: silu(gate) * up from the GEMM's
            # tiles (the same bits), as layer_loop.cpp decides it.
            if p.n % 32 == 0 and not self.gelu:
                return ops.packed_gemm_silu(x, p)
            return act_and_mul(matmul(x, p))

        all_reduce = self.all_reduce

        def row_parallel(x: torch.Tensor, p: CppPackedWeight) -> torch.Tensor:
            # A shard's o/down: float32 partial sums, summed over the ranks, rounded
            # once, as the whole GEMM rounds its one sum (bf16 partials would round twice).
            assert all_reduce is not None
            out = ops.packed_gemm(x, p, True)
            all_reduce(out)
            return out.to(x.dtype)

        # The step's adapters' deltas: the layer loop's kernel (csrc lora_delta), the same bits.
        lora_step = None if lora is None else self._lora_step(lora)

        def delta(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
            assert lora_step is not None
            ops.lora_delta(out, x, lora_step[0], lora_step[1], layer, LORA_PROJECTIONS.index(projection))
            return out

        def moe_mlp(x: torch.Tensor, experts: _Experts) -> torch.Tensor:
            return ops.moe_mlp(x, *experts)

        gemm, gemm_act, moe = linear_row(matmul), linear_row(mlp_act), linear_row(moe_mlp)
        gemm_out = gemm if all_reduce is None else linear_row(row_parallel)
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
            if lora_step is not None:  # (before RoPE and the cache write, as the reference adds it)
                qkv = delta(qkv, x, i, "qkv_proj")
            layer_meta = meta.for_layer(i)  # (its KV group's slots and tables)
            ops.rope_qkv_cache(qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, layer.cos,
                               layer.sin, kv_cache, layer_meta.slot_mapping, layer.q_norm, layer.k_norm, eps)
            q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
            if i == 0:
                call = self.attention.kernel_call(q, kv_cache, meta)
            # (With LoRA every row goes on: the segments' rows index the whole step.)
            if i == last and output_rows is not None and call is not None and lora_step is None:
                # Every K/V is written: the rest of the layer for the rows out only.
                call = call.rows(output_rows)
                q, residual, n = q[output_rows], residual[output_rows], output_rows.numel()
                output_rows = None  # done
            with record_function("tokenmill::attention") if profiling else nullcontext():
                if call is not None:
                    out = self.attention.run(call, q, kv_cache, layer.scale, layer.sliding_window,
                                             layer.logit_softcap, meta.group_of(i), layer.sinks)
                else:
                    out = self.attention.attend(q, kv_cache, layer_meta, layer.scale, layer.sliding_window,
                                                layer.logit_softcap, layer.sinks)
            attn = out.reshape(n, self.q_size)
            hidden = gemm_out(attn, layer.o)
            if lora_step is not None:
                hidden = delta(hidden, attn, i, "o_proj")
            if layer.attn_out_norm.numel():  # (Gemma: the attention's output normed before the add)
                hidden = ops.rms_norm(hidden, layer.attn_out_norm, eps)
            ops.fused_add_rms_norm(hidden, residual, layer.norm2, eps)
            if layer.experts is not None:  # (no LoRA, no shard: the engine and ShardLayout refuse them)
                hidden = moe(hidden, layer.experts)
            elif lora_step is None:
                assert layer.gate_up is not None and layer.down is not None
                hidden = gemm_out(gemm_act(hidden, layer.gate_up), layer.down)
            else:  # (the activation apart from the GEMM, so the delta joins gate/up before it)
                assert layer.gate_up is not None and layer.down is not None
                act = act_and_mul(delta(gemm(hidden, layer.gate_up), hidden, i, "gate_up_proj"))
                hidden = delta(gemm_out(act, layer.down), act, i, "down_proj")
            if layer.mlp_out_norm.numel():  # (Gemma: the MLP's output normed before the add)
                hidden = ops.rms_norm(hidden, layer.mlp_out_norm, eps)
        if output_rows is not None:  # (no attention kernel call: the torch attention ran)
            hidden, residual = hidden[output_rows], residual[output_rows]
        if not self.layers:
            return ops.rms_norm(hidden, self.final_norm, eps)
        ops.fused_add_rms_norm(hidden, residual, self.final_norm, eps)
        return hidden


def lora_weights(ops: CpuOps, adapter: LoRAAdapter, dtype: torch.dtype) -> CppLoraAdapterWeights:
    """`adapter` packed for the layer loop's lora_delta, its weights in `dtype`
    (the model's: vLLM's lora_dtype "auto"; a bf16 model's adapters read half
    the bytes), every layer's four projections in LORA_PROJECTIONS' order."""
    empty = torch.empty(0)
    ws = [layer.get(name) for layer in adapter.layers for name in LORA_PROJECTIONS]
    return ops.LoraAdapterWeights(
        a=[empty if w is None else w.a for w in ws], b=[empty if w is None else w.b for w in ws],
        scale=[empty if w is None else w.scale for w in ws],
        parts=[empty if w is None else torch.tensor(w.parts, dtype=torch.int64) for w in ws], dtype=dtype)


def _data_numel(weight: CppPackedWeight) -> int:
    """The elements of a packed weight's data, its parts' included."""
    return weight.data.numel() + sum(_data_numel(part) for part in weight.parts)


def _experts_of(mlp: SparseMoeBlock) -> list[LlamaMLP]:
    experts = list(mlp.experts)
    assert all(isinstance(e, LlamaMLP) for e in experts)
    return cast("list[LlamaMLP]", experts)


def _mlp_row_numel(layer: _Layer) -> int:
    """The elements of the MLP weights a row goes through: the dense MLP's, or the
    router's and top_k experts' (the first expert's size each)."""
    if layer.experts is None:
        assert layer.gate_up is not None and layer.down is not None
        return _data_numel(layer.gate_up) + _data_numel(layer.down)
    ex = layer.experts
    return _data_numel(ex.router) + ex.top_k * (_data_numel(ex.gate_up[0]) + _data_numel(ex.down[0]))


def _mlp_weights(layer: _Layer) -> dict[str, Any]:
    """A layer's MLP as LayerWeights takes it: gate_up and down, or a router and experts."""
    if layer.experts is None:
        return {"gate_up": layer.gate_up, "down": layer.down}
    ex = layer.experts
    return {"router": ex.router, "experts_gate_up": ex.gate_up, "experts_down": ex.down, "top_k": ex.top_k,
            "norm_topk_prob": ex.norm_topk_prob, "topk_then_softmax": ex.topk_then_softmax,
            "swiglu_limit": ex.swiglu_limit, "swiglu_alpha": ex.swiglu_alpha}


def threads() -> int:
    """The threads a forward may use (tests set more than a machine has)."""
    return torch.get_num_threads()


def head_rows(head: CppPackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a dense packed weight (formats.pack_weight's layout), as
    the weight's own rows: an embedding table tied to the head, read from it."""
    data, flat = head.data, ids.reshape(-1)
    if data.dim() == 4:  # bf16 [N/16, K/2, 16, 2]
        rows = data.permute(0, 2, 1, 3)[flat // 16, flat % 16]  # [n, K/2, 2]
    else:  # float32 [N/16, K, 16]
        rows = data.permute(0, 2, 1)[flat // 16, flat % 16]  # [n, K]
    return rows.reshape(*ids.shape, head.k)
