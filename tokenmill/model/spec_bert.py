"""Encoder-only models (BERT, XLM-RoBERTa: bge, e5, MiniLM and their cross-encoders):
their ModelSpec from a config.json.

An encoder is not the Llama layer: model/bert.py is its own module (post-LayerNorm
blocks, a GELU MLP, learned absolute positions, token type embeddings,
bidirectional attention). The spec keeps the decoder's names where the meaning
is the same (hidden_size, num_heads, ...), `rms_norm_eps` holding the
LayerNorms' epsilon, and adds `encoder_only`, `type_vocab_size`,
`position_offset` (XLM-R counts positions from padding_idx + 1, so its table's
first padding_idx + 1 rows are never a real token's and the context is that
much shorter) and `num_labels` (a *ForSequenceClassification's classifier).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.config import ModelSpec
from tokenmill.model.spec_checks import positive_float, positive_int

BERT_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
XLM_ROBERTA_ARCHITECTURES = ("XLMRobertaModel", "XLMRobertaForSequenceClassification")
ENCODER_ARCHITECTURES = (*BERT_ARCHITECTURES, *XLM_ROBERTA_ARCHITECTURES)
ENCODER_MODEL_TYPES = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel"}
CLASSIFIER_ARCHITECTURES = ("BertForSequenceClassification", "XLMRobertaForSequenceClassification")


def encoder_spec(cfg: Mapping[str, Any], architecture: str, path: str) -> ModelSpec:
    """The spec of an encoder's config.json (`architecture` one of ENCODER_ARCHITECTURES);
    a ValueError naming the file and field for what model/bert.py does not compute."""
    def require(key: str) -> int:
        if cfg.get(key) is None:
            raise ValueError(f"{path} has no {key!r}; is this a complete model config?")
        return positive_int(cfg[key], key, path)

    hidden_size, num_heads = require("hidden_size"), require("num_attention_heads")
    if hidden_size % num_heads:
        raise ValueError(f"{path}: hidden_size={hidden_size} is not divisible by "
                         f"num_attention_heads={num_heads}")
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"{path}: hidden_act={act!r} is not supported for an encoder; only 'gelu' is")
    position_type = cfg.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"{path}: position_embedding_type={position_type!r} is not supported; "
                         "only 'absolute' (learned positions) is")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError(f"{path}: is_decoder / add_cross_attention are not supported; "
                         "tokenmill runs BERT-style models as encoders only")
    max_positions = require("max_position_embeddings")
    offset = None
    if architecture in XLM_ROBERTA_ARCHITECTURES:
        # Positions padding_idx + 1 .. max_position_embeddings - 1 (HF's
        # create_position_ids_from_input_ids): a context of that many tokens.
        pad = cfg.get("pad_token_id", 1)
        offset = 0 if pad is None else int(pad)
        max_positions -= offset + 1
        if max_positions < 1:
            raise ValueError(f"{path}: max_position_embeddings={cfg['max_position_embeddings']} leaves "
                             f"no position past pad_token_id={pad}")
    type_vocab_size = positive_int(cfg.get("type_vocab_size", 2), "type_vocab_size", path)
    eos = cfg.get("eos_token_id")
    return ModelSpec(
        architecture=architecture,
        vocab_size=require("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=require("intermediate_size"),
        num_layers=require("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden_size // num_heads,
        rms_norm_eps=positive_float(cfg.get("layer_norm_eps", 1e-12), "layer_norm_eps", path),
        rope_theta=10000.0,  # (no RoPE: learned positions)
        max_position_embeddings=max_positions,
        hidden_act="gelu",
        eos_token_ids=(int(eos),) if isinstance(eos, int) and not isinstance(eos, bool) else (),
        encoder_only=True,
        type_vocab_size=type_vocab_size,
        position_offset=offset,
        num_labels=_num_labels(cfg, path) if architecture in CLASSIFIER_ARCHITECTURES else 0,
    )


def _num_labels(cfg: Mapping[str, Any], path: str) -> int:
    """transformers' rule: id2label's length, else num_labels, else 2."""
    id2label = cfg.get("id2label")
    if isinstance(id2label, Mapping) and id2label:
        return len(id2label)
    return positive_int(cfg.get("num_labels", 2), "num_labels", path)
