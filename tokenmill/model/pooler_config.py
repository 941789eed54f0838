"""How a model's pooling requests pool (config.PoolerConfig), read from its
directory: sentence-transformers' modules.json names the modules after the
transformer (a Pooling module's folder holds its config.json; a Normalize
module normalises), and the HF config.json says whether the model was trained
for Matryoshka truncation (is_matryoshka / matryoshka_dimensions, as vLLM reads
them). A model without modules.json (a plain decoder, a GGUF file) pools its
last token, normalised: vLLM's default for a decoder, Qwen3-Embedding's recipe."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.config import PoolerConfig

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"

# 1_Pooling/config.json's modes, as config.POOLING_TYPES.
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
          "pooling_mode_cls_token": "CLS"}
# Modes sentence-transformers has and tokenmill does not compute.
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


def read_pooler_config(path: str, default_pooling_type: str = "LAST") -> PoolerConfig:
    """The pooler of the model at `path` (a directory or a GGUF file); ValueError
    naming the file and field for a pooling tokenmill cannot compute.
    `default_pooling_type`: where no Pooling module says (a decoder's LAST; an
    encoder's CLS, as vLLM pools a BertModel)."""
    if not os.path.isdir(path):
        return PoolerConfig(pooling_type=default_pooling_type)
    matryoshka = _matryoshka(os.path.join(path, "config.json"))
    modules_path = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_path):
        return PoolerConfig(pooling_type=default_pooling_type, is_matryoshka=matryoshka is not None,
                            matryoshka_dimensions=matryoshka or None)
    modules = _read(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_path} must be a list of modules (objects with 'type' and 'path')")
    types = [str(m.get("type", "")) for m in modules]
    unknown = [t for t in types if t not in (TRANSFORMER_MODULE, POOLING_MODULE, NORMALIZE_MODULE)]
    if unknown:
        raise ValueError(f"{modules_path}: module types {unknown} are not supported (tokenmill "
                         f"runs {TRANSFORMER_MODULE}, then {POOLING_MODULE} and {NORMALIZE_MODULE})")
    pooling_type = default_pooling_type
    pooling = next((m for m in modules if m.get("type") == POOLING_MODULE), None)
    if pooling is not None:
        pooling_type = _pooling_type(os.path.join(path, str(pooling.get("path", "")), "config.json"))
    return PoolerConfig(
        pooling_type=pooling_type, normalize=NORMALIZE_MODULE in types,
        is_matryoshka=matryoshka is not None, matryoshka_dimensions=matryoshka or None,
    )


def cross_encoder_pooler_config(path: str, num_labels: int) -> PoolerConfig:
    """A cross-encoder's (a *ForSequenceClassification's) pooler: its first token
    through the model's classifier, then the activation vLLM applies by default
    (its get_act_fn): config.json's problem_type (regression: none; multi-label:
    sigmoid), else sentence-transformers' activation_fn (Identity, Sigmoid,
    Softmax; sbert_ce_default_activation_function in older files), else sigmoid
    for one label and softmax for several."""
    config_path = os.path.join(path, "config.json")
    cfg = _read(config_path) if os.path.isfile(config_path) else {}
    cfg = cfg if isinstance(cfg, dict) else {}
    classify = "sigmoid" if num_labels < 2 else "softmax"
    problem = cfg.get("problem_type")
    st = cfg.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or cfg.get("sbert_ce_default_activation_function")
    if problem == "regression":
        activation = "identity"
    elif problem == "multi_label_classification":
        activation = "sigmoid"
    elif problem == "single_label_classification" or name is None:
        activation = classify
    elif name in _ACTIVATION_FNS:
        activation = _ACTIVATION_FNS[name] or classify
    else:
        raise ValueError(f"{config_path}: activation_fn {name!r} is not supported; tokenmill "
                         f"applies one of {sorted(_ACTIVATION_FNS)}")
    return PoolerConfig(pooling_type="CLS", normalize=False, num_labels=num_labels, activation=activation)


# sentence-transformers' activation_fn names -> PoolerConfig.activation (None: by the
# label count, as vLLM treats Sigmoid and Softmax alike).
_ACTIVATION_FNS: dict[str, str | None] = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": None,
    "torch.nn.modules.activation.Softmax": None,
}


def _pooling_type(config_path: str) -> str:
    cfg = _read(config_path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_path} must be a JSON object")
    on = [key for key in (*_MODES, *_UNSUPPORTED_MODES) if cfg.get(key) is True]
    if len(on) != 1 or on[0] in _UNSUPPORTED_MODES:
        raise ValueError(f"{config_path}: pooling modes {on or 'none'} are on; tokenmill pools "
                         f"with exactly one of {sorted(_MODES)}")
    if cfg.get("include_prompt", True) is not True:
        raise ValueError(f"{config_path}: include_prompt=false is not supported (every prompt "
                         "token is pooled)")
    return _MODES[on[0]]


def _matryoshka(config_path: str) -> tuple[int, ...] | None:
    """None where the model was not trained for truncation; else its allowed
    dimensions (an empty tuple: any)."""
    if not os.path.isfile(config_path):
        return None
    cfg = _read(config_path)
    dims = cfg.get("matryoshka_dimensions") if isinstance(cfg, dict) else None
    if dims:
        if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ValueError(f"{config_path}: matryoshka_dimensions must be a list of positive "
                             f"integers, got {dims!r}")
        return tuple(dims)
    return () if isinstance(cfg, dict) and cfg.get("is_matryoshka") is True else None


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
