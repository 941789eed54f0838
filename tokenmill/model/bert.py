"""Encoder-only models: BERT and XLM-RoBERTa (bge, e5, MiniLM, and their
cross-encoders) as one nn.Module, the reference forward in plain torch.

Parameter names are Hugging Face's base-model names (`embeddings.word_embeddings`,
`encoder.layer.N.attention.self.query`, ...; the loader strips a
*ForSequenceClassification's `bert.` / `roberta.` prefix), so the loader's strict
name check holds. A block is post-LayerNorm:

    h = LN(h + O(attn(h)));  h = LN(h + W2 gelu(W1 h))

Attention is bidirectional: every token of a prompt attends to every token of
the same prompt, so a prompt runs whole in one step (the engine schedules it
so) and nothing is cached: `kv_caches` is ignored. The batch is ragged as the
decoder's: the prompts concatenated, `meta.query_start_loc` their bounds.
Positions are learned and absolute (XLM-R's from padding_idx + 1, padding
tokens keeping padding_idx, as transformers counts them); token types come
with the request (a cross-encoder's text pair: 0 for the first text, 1 for
the second; zeros otherwise).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelSpec
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.llama import Embedding, Linear


class _LayerNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:  # (the loader fills every weight)
        pass


class _Dense(nn.Module):
    """HF's `*Output` block: LN(x + dense(h))."""

    def __init__(self, in_features: int, spec: ModelSpec, device: torch.device | str | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(in_features, spec.hidden_size, device=device, dtype=dtype)
        self.LayerNorm = _LayerNorm(spec.hidden_size, eps=spec.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class _SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        h = spec.hidden_size
        self.query = Linear(h, h, device=device, dtype=dtype)
        self.key = Linear(h, h, device=device, dtype=dtype)
        self.value = Linear(h, h, device=device, dtype=dtype)


class _Attention(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.add_module("self", _SelfAttention(spec, device, dtype))  # (HF's name)
        self.output = _Dense(spec.hidden_size, spec, device, dtype)

    def forward(self, hidden: torch.Tensor, bounds: list[int]) -> torch.Tensor:  # [num_tokens, hidden]
        attn = self.get_submodule("self")
        assert isinstance(attn, _SelfAttention)
        n = hidden.shape[0]
        q, k, v = (proj(hidden).view(n, self.num_heads, self.head_dim).transpose(0, 1)
                   for proj in (attn.query, attn.key, attn.value))  # [heads, num_tokens, head_dim]
        # Each prompt attends to itself only, every token to every token.
        out = torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b])
                         for a, b in itertools.pairwise(bounds)], dim=1)
        return self.output(out.transpose(0, 1).reshape(n, -1), hidden)


class _Intermediate(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(spec.hidden_size, spec.intermediate_size, device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden))  # (hidden_act "gelu": exact, as HF's)


class EncoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = _Attention(spec, device, dtype)
        self.intermediate = _Intermediate(spec, device, dtype)
        self.output = _Dense(spec.intermediate_size, spec, device, dtype)

    def forward(self, hidden: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        hidden = self.attention(hidden, bounds)
        return self.output(self.intermediate(hidden), hidden)


class _Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        num_positions = spec.max_position_embeddings + (
            0 if spec.position_offset is None else spec.position_offset + 1)
        h = spec.hidden_size
        self.word_embeddings = Embedding(spec.vocab_size, h, device=device, dtype=dtype)
        self.position_embeddings = Embedding(num_positions, h, device=device, dtype=dtype)
        self.token_type_embeddings = Embedding(spec.type_vocab_size, h, device=device, dtype=dtype)
        self.LayerNorm = _LayerNorm(h, eps=spec.rms_norm_eps, device=device, dtype=dtype)


class _Encoder(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(spec, device, dtype) for _ in range(spec.num_layers))


class _Pooler(nn.Module):
    """BERT's pooler (dense, tanh), which its classifier reads; XLM-R's head is
    the same pair under the names classifier.dense / classifier.out_proj."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(spec.hidden_size, spec.hidden_size, device=device, dtype=dtype)


class _RobertaHead(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(spec.hidden_size, spec.hidden_size, device=device, dtype=dtype)
        self.out_proj = Linear(spec.hidden_size, spec.num_labels, device=device, dtype=dtype)


class EncoderModel(nn.Module):
    """BertModel / XLMRobertaModel, and with spec.num_labels their
    *ForSequenceClassification heads. Weights are allocated uninitialised;
    `tokenmill.model.loader` fills them all."""

    def __init__(self, spec: ModelSpec, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        assert spec.encoder_only, spec.architecture
        self.spec = spec
        self.embeddings = _Embeddings(spec, device, dtype)
        self.encoder = _Encoder(spec, device, dtype)
        self.pooler: _Pooler | None = None
        self.classifier: nn.Module | None = None
        if spec.num_labels and spec.position_offset is None:  # BERT: pooler, then a Linear
            self.pooler = _Pooler(spec, device, dtype)
            self.classifier = Linear(spec.hidden_size, spec.num_labels, device=device, dtype=dtype)
        elif spec.num_labels:  # XLM-R: dense, tanh, out_proj
            self.classifier = _RobertaHead(spec, device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64: whole prompts, concatenated
        positions: torch.Tensor,  # [num_tokens] int64: each token's place in its prompt
        kv_caches: list[torch.Tensor],  # (unused: an encoder keeps no K/V)
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,  # [num_tokens] int64; None: zeros
    ) -> torch.Tensor:  # [num_tokens or len(output_rows), hidden]
        bounds = list(meta.query_start_loc)
        emb = self.embeddings
        if self.spec.position_offset is not None:
            positions = self._roberta_positions(input_ids, bounds)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # (HF's order: words + types, then + positions, then the norm)
        hidden = emb.word_embeddings(input_ids) + emb.token_type_embeddings(token_type_ids)
        hidden = emb.LayerNorm(hidden + emb.position_embeddings(positions))
        for layer in self.encoder.layer:
            hidden = layer(hidden, bounds)
        return hidden if output_rows is None else hidden[output_rows]

    def _roberta_positions(self, input_ids: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """transformers' create_position_ids_from_input_ids, prompt by prompt:
        padding_idx + the count of non-padding tokens so far (padding_idx itself
        for a padding token)."""
        pad = self.spec.position_offset
        assert pad is not None
        mask = (input_ids != pad).long()
        counts = torch.cat([mask[a:b].cumsum(0) for a, b in itertools.pairwise(bounds)])
        return counts * mask + pad

    def classify(self, cls_row: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits [num_labels] (float32) from its first token's
        last hidden state [hidden] (any float dtype), in the model's dtype as HF's."""
        assert self.classifier is not None, "this encoder has no classifier (num_labels 0)"
        x = cls_row.to(self.embeddings.word_embeddings.weight.dtype)
        if self.pooler is not None:
            return self.classifier(torch.tanh(self.pooler.dense(x))).float()
        assert isinstance(self.classifier, _RobertaHead)
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(x))).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.spec.architecture} is an encoder: it pools, it has no logits "
                           "to sample (the engine refuses generation requests for it)")
