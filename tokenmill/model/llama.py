"""The Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3), Gemma 2 / 3 and the
mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss) as one nn.Module.

Module and parameter names mirror Hugging Face's (`model.layers.0.self_attn...`)
except two fused projections, one matmul each instead of three and two:

    qkv_proj.weight      = [q_proj; k_proj; v_proj]     rows: heads*hd | kv*hd | kv*hd
    gate_up_proj.weight  = [gate_proj; up_proj]         rows: intermediate | intermediate

The loader fills each shard through `MergedLinear.shard_slice`. The numerics
follow transformers' order of operations, so fp32 results match it closely.

Gemma is the same layer with the ModelSpec's Gemma fields, each a branch taken
once when the module is built: (1 + w) RMSNorms, norms on the attention's and
the MLP's outputs (HF's names: post_attention_layernorm is the attention's,
pre_/post_feedforward_layernorm the MLP's), GeGLU, the embedding scaled by
sqrt(hidden), the query scale, per-layer windows and RoPE bases, soft-capping.

This is the reference forward: plain torch, on any device (CUDA included).
The CPU fast path (tokenmill/backends/cpu) builds its plan from these modules'
weights and is tested against this code; nothing here knows about it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from tokenmill.config import ModelSpec
from tokenmill.model.attention import AttentionBackend, TorchAttentionBackend
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.lora import LoRABatch
from tokenmill.model.quantization import dense_weight, embed_rows, is_quantized
from tokenmill.model.rope import RotaryEmbedding, apply_rotary_emb

# Rows per F.linear call of an invariant bf16 linear on the CPU (linear below).
INVARIANT_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """F.linear, except for bfloat16 rows on the CPU, where torch's matmul picks
    its kernel by the row count, and kernels sum in other orders: a row's bits
    depend on how many rows came with it (M = 1 against 2, and M >= 4 against 2,
    irregularly), while at one row count they do not depend on the other rows.
    - batch_invariant: every call takes INVARIANT_ROWS rows (the last block
      padded with zeros), so a row gives the same bits in a decode of one, a
      step of many, or a prompt's chunk; 8 rows cost a 1-row decode's linear
      about 3-4.5x and a 512-row prefill's 1.5-1.7x (docs/perf-notes.md).
    - else one row goes as two (the row twice), so that decode rows agree among
      themselves (a decode alone and beside others); the second row costs next
      to nothing, one row being bound by reading the weight."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if batch_invariant:
        m = x.shape[0]
        pad = -m % INVARIANT_ROWS
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        blocks = [F.linear(x[i:i + INVARIANT_ROWS], weight, bias) for i in range(0, m + pad, INVARIANT_ROWS)]
        return torch.cat(blocks)[:m]
    if x.shape[0] == 1:
        return F.linear(x.expand(2, -1).contiguous(), weight, bias)[:1]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear without random init: the loader fills every weight, and
    initialising a large model would take longer than loading it."""

    batch_invariant = False  # linear()'s; LlamaForCausalLM.set_batch_invariant sets it per model

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (quantized: model/quantization.py; the weight dequantized each call)
        weight = self.weight if "weight" in self._parameters else dense_weight(self, x.dtype)
        if torch.autograd._profiler_enabled():  # a row of its own in `bench throughput --profile`
            with record_function("tokenmill::linear"):
                return linear(x, weight, self.bias, self.batch_invariant)
        return linear(x, weight, self.bias, self.batch_invariant)


def project(linear: nn.Module, x: torch.Tensor, lora: LoRABatch | None, layer: int,
            name: str) -> torch.Tensor:
    """A decoder projection: the base Linear (any weight format), plus the
    step's LoRA deltas on their rows (LoRABatch.add_delta, the one place)."""
    out: torch.Tensor = linear(x)
    return out if lora is None else lora.add_delta(out, x, layer, name)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not is_quantized(self):
            return super().forward(input)
        return embed_rows(self, input, self.compute_dtype)

    compute_dtype: torch.dtype = torch.float32  # a quantized table's rows come out in it (the loader sets it)


class MergedLinear(Linear):
    """A Linear whose output rows are several checkpoint tensors stacked (shards)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],  # shard id -> output rows, in order
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, device=device, dtype=dtype)
        self.shard_sizes = dict(shard_sizes)

    def shard_slice(self, shard_id: str) -> slice:
        """The output rows (of weight and bias) that hold shard `shard_id`."""
        start = 0
        for name, size in self.shard_sizes.items():
            if name == shard_id:
                return slice(start, start + size)
            start += size
        raise KeyError(shard_id)


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, device: torch.device | str | None, dtype: torch.dtype,
        unit_offset: bool = False, float32_scale: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma: scale by (1 + w), in float32
        self.float32_scale = float32_scale  # gpt-oss: scale by w in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, then scale in the input dtype, exactly as HF
        # (Gemma and gpt-oss scale in float32 and cast after: their HF RMSNorms).
        input_dtype = x.dtype
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x_fp32 * (1.0 + self.weight.float())).to(input_dtype)
        if self.float32_scale:
            return (self.weight.float() * x_fp32).to(input_dtype)
        return self.weight * x_fp32.to(input_dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and the
        next norm as one call, the pair the CPU plan fuses into one kernel."""
        residual = x + residual
        return self.forward(residual), residual


class RopeBatch:
    """Each token's position and the rotary tables, shared by all layers of one
    forward; cos/sin are gathered once, on first use."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary = rotary
        self.positions = positions
        self.dtype = dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, 1, head_dim] each
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions, self.dtype)
        return self._cos_sin


class LlamaAttention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        device: torch.device | str | None,
        dtype: torch.dtype,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        scalar = spec.head_dim if spec.query_pre_attn_scalar is None else spec.query_pre_attn_scalar
        self.scale = scalar**-0.5
        self.sliding_window = spec.layer_window(layer)
        self.logit_softcap = spec.attn_logit_softcapping
        self.backend = backend
        self.layer = layer  # (LoRA adapters' weights are per layer)
        self.qkv_proj = MergedLinear(
            spec.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=spec.attention_bias,
            device=device,
            dtype=dtype,
        )
        # Qwen2 puts biases on q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = spec.attention_bias and spec.architecture != "Qwen2ForCausalLM"
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=o_bias, device=device, dtype=dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device, dtype, spec.norm_unit_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device, dtype, spec.norm_unit_offset)
        # gpt-oss: a learned logit per query head that every softmax's denominator includes
        self.sinks: nn.Parameter | None = None
        if spec.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(spec.num_heads, device=device, dtype=dtype))

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        rope: RopeBatch,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = hidden.shape[0]
        qkv = project(self.qkv_proj, hidden, lora, self.layer, "qkv_proj")  # [num_tokens, q + 2 kv]
        cos, sin = rope.cos_sin()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3, Gemma 3: per head, before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary_emb(q, cos, sin)
        k = apply_rotary_emb(k, cos, sin)
        with record_function("tokenmill::attention"):
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                                       self.logit_softcap, self.sinks)
        return project(self.o_proj, out.reshape(num_tokens, self.q_size), lora, self.layer, "o_proj")


class LlamaMLP(nn.Module):
    def __init__(
        self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype, layer: int = 0,
        intermediate_size: int | None = None,  # an expert's (None: the model's)
    ) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate_size = spec.intermediate_size if intermediate_size is None else intermediate_size
        self.geglu = spec.hidden_act == "gelu_pytorch_tanh"  # Gemma (else SwiGLU)
        expert = intermediate_size is not None
        # gpt-oss's experts: biases, and the clamped SwiGLU (ModelSpec.swiglu_limit)
        self.limit = spec.swiglu_limit if expert else None
        self.alpha = spec.swiglu_alpha
        bias = expert and spec.moe_bias
        self.gate_up_proj = MergedLinear(
            spec.hidden_size,
            {"gate": self.intermediate_size, "up": self.intermediate_size},
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.down_proj = Linear(
            self.intermediate_size,
            spec.hidden_size,
            bias=bias,
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = project(self.gate_up_proj, x, lora, self.layer, "gate_up_proj")
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.limit is not None:  # gpt-oss, as HF's GptOssExperts._apply_gate
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return project(self.down_proj, (up + 1) * (gate * torch.sigmoid(gate * self.alpha)), lora,
                           self.layer, "down_proj")
        act = F.gelu(gate, approximate="tanh") if self.geglu else F.silu(gate)
        return project(self.down_proj, act * up, lora, self.layer, "down_proj")


class Router(Linear):
    """A mixture of experts' router (HF's `mlp.gate`): stays in the model's float
    dtype under every quantization, as llama.cpp and vLLM keep it, since a
    rounded logit can pick another expert."""

    keep_float = True


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's and Mixtral's MLP: each token's output is the weighted sum of
    the SwiGLU experts its router ranks top k. As transformers computes it: the
    router's logits in the dtype, softmax in float32, the top k (renormalised
    where the config says), the weights cast to the dtype; each expert's output
    times its weight, added in the dtype in increasing expert order (index_add),
    so a row's sum has one order whatever else is in the step."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.topk_then_softmax = spec.moe_topk_then_softmax
        self.gate = Router(spec.hidden_size, spec.num_experts, bias=spec.moe_bias, device=device, dtype=dtype)
        self.experts = nn.ModuleList(
            LlamaMLP(spec, device, dtype, layer, spec.moe_intermediate_size) for _ in range(spec.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] in x's dtype, expert ids [n, k]) of each row."""
        if self.topk_then_softmax:  # gpt-oss: the top k logits, softmaxed in the dtype
            top, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        assert lora is None, "LoRA adapters on experts are refused at load (engine/arg_utils.py)"
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():  # (sorted: increasing expert order, as HF's loop)
            rows, slot = torch.where(ids == e)
            y = self.experts[e](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        device: torch.device | str | None,
        dtype: torch.dtype,
        layer: int = 0,
    ) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype, spec.norm_unit_offset,
                           spec.norm_in_float32)

        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(spec, backend, device, dtype, layer)
        self.post_attention_layernorm = norm()  # Llama: before the MLP; Gemma: after the attention
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(spec, device, dtype, layer) if spec.layer_moe(layer) else LlamaMLP(spec, device, dtype, layer))
        self.local_rope = spec.layer_local_rope(layer)  # Gemma 3's sliding layers: their own base
        self.sandwich = spec.sandwich_norms
        if self.sandwich:  # Gemma: a norm before the MLP and one after it
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output
        residual: torch.Tensor | None,  # the residual stream before that output; None: layer 0
        rope: RopeBatch,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, residual before it)
        # HF's h = h + attn(norm(h)); h = h + mlp(norm(h)), with each residual add
        # done together with the norm that follows it (as vLLM does).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, meta, lora)
        if not self.sandwich:
            hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
            return self.mlp(hidden, lora), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm.add_forward(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden, lora)), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        max_positions: int,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, backend, device, dtype, i) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype, spec.norm_unit_offset,
                            spec.norm_in_float32)
        self.rotary_emb = RotaryEmbedding(
            spec.head_dim, spec.rope_theta, spec.rope_scaling, max_positions, device, spec.rotary_dim
        )
        # Gemma 3's sliding layers rotate with their own base (unscaled, as HF's).
        self.local_rotary_emb: RotaryEmbedding | None = None
        if spec.local_rope_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(
                spec.head_dim, spec.local_rope_theta, None, max_positions, device
            )
        # Gemma: the rows times sqrt(hidden), that scalar rounded to the dtype as HF's.
        self.embed_scale = spec.hidden_size**0.5 if spec.scale_embeddings else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # see LlamaForCausalLM.forward
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [num_tokens or len(output_rows), hidden]
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale).to(hidden.dtype)
        rope = RopeBatch(self.rotary_emb, positions, hidden.dtype)
        local = rope
        if self.local_rotary_emb is not None:
            local = RopeBatch(self.local_rotary_emb, positions, hidden.dtype)
        residual: torch.Tensor | None = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, residual = layer(hidden, residual, local if layer.local_rope else rope, kv_cache,
                                     meta.for_layer(i), lora)
        if output_rows is not None:  # (the CPU plan skips the other rows' last layer)
            hidden = hidden[output_rows]
            residual = None if residual is None else residual[output_rows]
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_forward(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Weights are allocated uninitialised; `tokenmill.model.loader` fills them all."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        max_positions: int | None = None,  # RoPE table length; default max_position_embeddings
        attn_backend: AttentionBackend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.spec = spec
        backend = attn_backend if attn_backend is not None else TorchAttentionBackend()
        self.model = LlamaModel(
            spec, backend, max_positions or spec.max_position_embeddings, device, dtype
        )
        if spec.tie_word_embeddings:
            # One Parameter under two names; named_parameters() lists it once,
            # as model.embed_tokens.weight.
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(
                spec.hidden_size,
                spec.vocab_size,
                bias=False,
                device=device,
                dtype=dtype,
            )

    def set_batch_invariant(self, on: bool) -> None:
        """Every linear layer (the head included) batch-invariant or not (linear())."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.batch_invariant = on

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Every layer's attention through `backend` from now on (the runner
        picks it for the device at load time)."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.backend = backend

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], or [len(output_rows), hidden]
        """The last hidden states of every token, or only of the rows in
        `output_rows` (int64 indices; e.g. the rows that are sampled): the
        K/V of every token are written all the same. `lora`: the step's
        adapters and their rows (model/lora.py), added to every projection."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, output_rows, lora)

    def head_rows(self, token_ids: tuple[int, ...]) -> torch.Tensor:
        """The head's rows of `token_ids` as float32 [len, hidden]: their logits
        alone (a yes/no reranker's two), without the vocabulary-wide GEMM."""
        with torch.no_grad():
            return dense_weight(self.lm_head, torch.float32)[list(token_ids)].float().clone()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> logits [num_rows, vocab_size] float32
        (the sampler's dtype, whatever the model's)."""
        with record_function("tokenmill::head"):
            logits = linear(hidden, dense_weight(self.lm_head, hidden.dtype), None, self.lm_head.batch_invariant)
            cap = self.spec.final_logit_softcapping
            if cap is not None:  # Gemma 2: in the model's dtype, as HF
                logits = torch.tanh(logits / cap) * cap
            return logits.float()
