"""Sampling defaults from the model's generation config (vLLM's
`--generation-config auto|vllm|DIR`): read from a Hugging Face directory or a
GGUF file, applied offline (LLM.generate without params) and in the server to
what a request leaves unset; a request's own values win."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import pytest

from tests.hf_models import build_hf_model, save_hf_model
from tests.server_harness import ServerThread
from tokenmill import LLM, SamplingParams, default_model_path
from tokenmill.config import ServerConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.generation_config import default_sampling_params
from tokenmill.model.source import ModelSource
from tokenmill.server import build_app

PROMPT = [1, 17, 42, 99, 7]
GENERATION_CONFIG = {
    "temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3,
    "do_sample": True, "eos_token_id": 2, "transformers_version": "5.0.0",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("genconfig")
    save_hf_model(build_hf_model("llama"), directory)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(directory)


def test_defaults_from_a_directory(model_dir: str, tmp_path: Path) -> None:
    source = ModelSource("hf", model_dir, "tiny")
    # vLLM's fields only, max_new_tokens as max_tokens; do_sample and ids are not sampling defaults.
    assert default_sampling_params(source, "auto") == {
        "temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_tokens": 3}
    assert default_sampling_params(source, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert default_sampling_params(source, str(tmp_path)) == {"repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling_params(source, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="generation_config"):
        EngineArgs(generation_config="no/such/folder").create_engine_configs()


def test_defaults_from_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_uint32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert default_sampling_params(ModelSource("gguf", str(path), "x"), "auto") == {
        "temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25}
    # The default model's file carries no sampling keys: no defaults.
    assert default_sampling_params(ModelSource("gguf", default_model_path(), "x"), "auto") == {}


def test_offline_defaults(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, apply_process_settings=False)
    defaults = llm.get_default_sampling_params()
    assert defaults == SamplingParams(temperature=0.0, top_p=0.9, top_k=20, max_tokens=3)
    assert defaults.temperature == 0.0 and defaults.max_tokens == 3
    out = llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate({"prompt_token_ids": PROMPT},
                          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 3 and out.token_ids == greedy.token_ids[:len(out.token_ids)]
    # "vllm": no defaults (the engine reads the same function, tested above).
    llm.engine.default_sampling_params = default_sampling_params(llm.engine.source, "vllm")
    assert llm.get_default_sampling_params() == SamplingParams()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The default model with a generation config from a folder (DIR form)."""
    folder = tmp_path_factory.mktemp("genconfig-dir")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    engine = AsyncEngine(LLM(dtype="float32", kv_cache_memory_bytes=64 << 20,
                             apply_process_settings=False, generation_config=str(folder)).engine)
    thread = ServerThread(build_app(engine, ServerConfig())).start()
    try:
        yield thread
    finally:
        thread.stop()
        engine.shutdown()


def complete(server: ServerThread, **body: object) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "Once upon a time", "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_server_applies_defaults_to_unset_fields(server: ServerThread) -> None:
    # max_tokens: the generation config's 3 caps the request's (vLLM takes the smaller).
    assert complete(server)["usage"]["completion_tokens"] == 3
    assert complete(server, max_tokens=2)["usage"]["completion_tokens"] == 2
    assert complete(server, max_tokens=50)["usage"]["completion_tokens"] == 3
    # temperature unset: the config's 0 (greedy), so two calls agree, and n > 1 is
    # refused as it is for an explicit temperature=0.
    assert complete(server)["choices"][0]["text"] == complete(server)["choices"][0]["text"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "n": 6}, timeout=60)
    assert r.status_code == 400 and "temperature is 0" in r.json()["error"]["message"]
    # The request's own temperature wins: samples at 2.0 differ.
    sampled = complete(server, n=6, temperature=2.0, max_tokens=3)["choices"]
    assert len({c["text"] for c in sampled}) > 1
    # The chat endpoint too: greedy by default, so two calls agree.
    chat = {"messages": [{"role": "user", "content": "Name a color."}]}
    texts = set()
    for _ in range(2):
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 3
        texts.add(r.json()["choices"][0]["message"]["content"])
    assert len(texts) == 1
