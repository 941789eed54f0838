"""Sampling defaults from the model's generation config (vLLM's
`--generation-config`).

- "auto" (the default): the model's own. A Hugging Face directory's
  `generation_config.json`; a GGUF file's `general.sampling.*` keys (llama.cpp
  writes them when the model's authors published defaults; most files carry
  none).
- "vllm": none; the neutral SamplingParams defaults.
- a folder: the `generation_config.json` in it.

Only the sampling fields vLLM takes from it are used (`max_new_tokens` becomes
`max_tokens`), and only where the file sets them. They stand in for what a
request leaves unset; a request's own value always wins."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.source import ModelSource

# vLLM's list (ModelConfig.get_diff_sampling_param), in Hugging Face's names.
GENERATION_CONFIG_PARAMS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                            "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
# llama.cpp's GGUF keys for the same (gguf-py's Keys.General.SAMPLING_*).
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
FILE_NAME = "generation_config.json"


def check_generation_config(value: str) -> None:
    if value in ("auto", "vllm"):
        return
    if not os.path.isfile(os.path.join(value, FILE_NAME)):
        raise ValueError(f"generation_config={value!r}: give 'auto' (the model's own), 'vllm' "
                         f"(none) or a folder that holds a {FILE_NAME}")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read the generation config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"the generation config {path} is not a JSON object")
    return data


def raw_generation_config(source: ModelSource, generation_config: str) -> dict[str, Any]:
    """The generation config's fields, as the file has them ({} for "vllm")."""
    check_generation_config(generation_config)
    if generation_config == "vllm":
        return {}
    if generation_config != "auto":
        return _read_json(os.path.join(generation_config, FILE_NAME))
    if source.kind == "gguf":
        fields = GGUFFile(source.path).fields
        return {name: fields[key] for key, name in GGUF_SAMPLING_KEYS.items() if key in fields}
    path = os.path.join(source.path, FILE_NAME)
    return _read_json(path) if os.path.isfile(path) else {}


def default_sampling_params(source: ModelSource, generation_config: str) -> dict[str, Any]:
    """vLLM's get_diff_sampling_param(): SamplingParams field -> default value."""
    raw = raw_generation_config(source, generation_config)
    defaults = {p: raw[p] for p in GENERATION_CONFIG_PARAMS if raw.get(p) is not None}
    if "max_new_tokens" in defaults:  # Hugging Face's name for max_tokens
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults
