"""POST /v1/embeddings through real HTTP: the official `openai` client's
`embeddings.create` (float, base64, and its default: base64 decoded by the SDK)
and httpx, against a tiny random Qwen3 with a real tokenizer (Matryoshka-trained
by its config), beside generation traffic on the same engine. Every vector
equals transformers' last hidden state of the same tokens, last token pooled and
normalised, within 1e-5 (float32)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import transformers

from tests.hf_models import hf_embedding
from tests.qwen3_chat import save_qwen3_chat_model
from tests.server_harness import ServerThread
from tokenmill import LLM, SamplingParams
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server import build_app

TIMEOUT_S = 60.0
ATOL = 1e-5
MAX_MODEL_LEN = 128
MODEL = "tiny-embed"
TEXTS = [f"Passage {i}: the {color} fox jumps over {i} lazy dogs."
         for i, color in enumerate(["red", "blue", "green", "gold"] * 8)]
PROMPTS = ["Write about the sea.", "Count to five:", "The capital of France is", "Once upon"]


@dataclass
class Served:
    llm: LLM
    hf: Any
    engine: AsyncEngine
    server: ServerThread
    generated: list[str]  # offline greedy texts of PROMPTS, before the server started

    @property
    def url(self) -> str:
        return self.server.url

    def ids(self, text: str) -> list[int]:
        return self.llm.get_tokenizer().encode(text)

    def expected(self, text: str) -> np.ndarray:
        return hf_embedding(self.hf, self.ids(text), "last", normalize=True)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                             max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = save_qwen3_chat_model(tmp_path_factory.mktemp("qwen3-embed"), think_tokens=False)
    config = json.loads(Path(path, "config.json").read_text())
    Path(path, "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    llm = LLM(model=path, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=MAX_MODEL_LEN, apply_process_settings=False)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    generated = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(served_model_name=MODEL))).start()
    try:
        yield Served(llm, hf, engine, server, generated)
    finally:
        server.stop()
        engine.shutdown()


def post(served: Served, body: Any) -> httpx.Response:
    return httpx.post(served.url + "/v1/embeddings", json=body, timeout=TIMEOUT_S)


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    for word in words:
        assert word in error["message"]


def test_openai_sdk_float_and_base64(served: Served) -> None:
    client = served.client()
    expected = [served.expected(t) for t in TEXTS]
    # The SDK's default asks for base64 and decodes it itself.
    for fmt in ("float", None):
        kwargs = {} if fmt is None else {"encoding_format": fmt}
        out = client.embeddings.create(model=MODEL, input=TEXTS, **kwargs)
        assert [d.index for d in out.data] == list(range(len(TEXTS)))
        for d, ref in zip(out.data, expected, strict=True):
            np.testing.assert_allclose(d.embedding, ref, atol=ATOL)
        num_tokens = sum(len(served.ids(t)) for t in TEXTS)
        assert out.usage.prompt_tokens == out.usage.total_tokens == num_tokens
        assert out.object == "list" and out.data[0].object == "embedding"
    raw = client.embeddings.create(model=MODEL, input=TEXTS[0],
                                   encoding_format="base64")
    data = raw.data[0].embedding
    assert isinstance(data, str)  # (asked for explicitly, the SDK hands it over as sent)
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(data), dtype="<f4"), expected[0],
                               atol=ATOL)


def test_langchain_openai_embeddings(served: Served) -> None:
    """LangChain's OpenAIEmbeddings, unchanged but for sending strings
    (check_embedding_ctx_length=False: its default tokenizes with tiktoken's
    OpenAI encodings, which it downloads, and sends OpenAI's token ids)."""
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(model=MODEL, base_url=served.url + "/v1", api_key="unused",
                                check_embedding_ctx_length=False, chunk_size=3, max_retries=0)
    documents = TEXTS[:7]  # (three requests of at most 3 inputs)
    vectors = embedder.embed_documents(documents)
    query = embedder.embed_query(TEXTS[9])
    for text, vector in zip([*documents, TEXTS[9]], [*vectors, query], strict=True):
        np.testing.assert_allclose(vector, served.expected(text), atol=ATOL, rtol=0)
    assert asyncio.run(embedder.aembed_query(TEXTS[9])) == query


def test_one_at_a_time_equals_the_batch(served: Served) -> None:
    client = served.client()
    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data
    for i in (0, 13, 31):
        alone = client.embeddings.create(model=MODEL, input=TEXTS[i], encoding_format="float").data[0]
        np.testing.assert_allclose(alone.embedding, batch[i].embedding, atol=ATOL)


def test_token_id_inputs_and_fields(served: Served) -> None:
    ids = [served.ids(t) for t in TEXTS[:3]]
    one = post(served, {"input": ids[0]}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], served.expected(TEXTS[0]), atol=ATOL)
    assert one["usage"] == {"prompt_tokens": len(ids[0]), "total_tokens": len(ids[0]),
                            "completion_tokens": 0}
    many = post(served, {"input": ids}).json()
    for d, text in zip(many["data"], TEXTS[:3], strict=True):
        np.testing.assert_allclose(d["embedding"], served.expected(text), atol=ATOL)
    # Matryoshka (the config says is_matryoshka): the first 16, renormalised.
    cut = post(served, {"input": TEXTS[0], "dimensions": 16}).json()["data"][0]["embedding"]
    raw = hf_embedding(served.hf, served.ids(TEXTS[0]), "last", normalize=False)[:16]
    np.testing.assert_allclose(cut, raw / np.linalg.norm(raw), atol=ATOL)
    plain = post(served, {"input": TEXTS[0], "normalize": False}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(plain, hf_embedding(served.hf, served.ids(TEXTS[0]), "last", False),
                               atol=ATOL)


def test_mixed_with_generation_traffic(served: Served) -> None:
    """Chat streams and embeddings at once on one engine: every stream's greedy
    text is the offline one, every vector transformers'."""
    groups = [TEXTS[:16], TEXTS[16:], TEXTS[::3]]

    async def both() -> tuple[list[str], list[list[list[float]]]]:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused",
                                    timeout=TIMEOUT_S, max_retries=0)

        async def generate(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def embed(texts: list[str]) -> list[list[float]]:
            out = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
            return [d.embedding for d in out.data]

        gen = asyncio.gather(*(generate(p) for p in PROMPTS))
        vectors = await asyncio.gather(*(embed(g) for g in groups))
        return list(await gen), list(vectors)

    texts, vectors = asyncio.run(both())
    assert texts == served.generated
    for group, got in zip(groups, vectors, strict=True):
        for text, vector in zip(group, got, strict=True):
            np.testing.assert_allclose(vector, served.expected(text), atol=ATOL)


def test_bad_inputs_are_4xx_and_the_server_keeps_serving(served: Served) -> None:
    assert_error(post(served, {"input": []}), 400, "input", "input is empty")
    assert_error(post(served, {"input": ""}), 400, "input", "empty")
    assert_error(post(served, {"input": ["fine", ""]}), 400, "input", "input 1 is empty")
    assert_error(post(served, {"input": [[1, 2], []]}), 400, "input", "input 1 is empty")
    assert_error(post(served, {"input": "x", "dimensions": 65}), 400, "dimensions",
                 "at most the model's embedding size 64")
    assert_error(post(served, {"input": "x", "dimensions": 0}), 400, "dimensions", ">= 1")
    assert_error(post(served, {"input": "x", "encoding_format": "int8"}), 400, "encoding_format")
    assert_error(post(served, {"input": [10**9]}), 400, "input", "outside the vocabulary")
    assert_error(post(served, {"input": [True, 3]}), 400, "input", "booleans")
    long_ids = list(range(3, 3 + MAX_MODEL_LEN + 1))
    assert_error(post(served, {"input": long_ids}), 400, "input", "maximum context length is 128")
    assert_error(post(served, {"input": " word" * 400}), 400, "input", "maximum context length")
    too_big = post(served, {"input": "a" * (10 << 20)})  # 10 MB: past the body limit (8 MiB)
    assert too_big.status_code == 413, too_big.text
    assert "bytes" in too_big.json()["error"]["message"]
    assert_error(post(served, {"input": "x", "model": "other"}), 404, "model", "does not exist")
    for text in ("\ud800", ["ok", "a\udfffb"]):  # lone surrogates: JSON allows them, UTF-8 does not
        odd = httpx.post(served.url + "/v1/embeddings", content=json.dumps({"input": text}).encode(),
                         headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
        assert odd.status_code in (200, 400), odd.text
    # ... and it still serves, with every block back in the pool.
    ok = post(served, {"input": TEXTS[0]})
    assert ok.status_code == 200
    np.testing.assert_allclose(ok.json()["data"][0]["embedding"], served.expected(TEXTS[0]),
                               atol=ATOL)
    stats = served.engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_generate_only_server_refuses_embeddings(tmp_path: Path) -> None:
    path = save_qwen3_chat_model(tmp_path, think_tokens=False)
    llm = LLM(model=path, dtype="float32", kv_cache_memory_bytes=16 << 20, runner="generate",
              apply_process_settings=False)
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(served_model_name=MODEL))).start()
    try:
        response = httpx.post(server.url + "/v1/embeddings", json={"input": "hi"}, timeout=TIMEOUT_S)
        assert_error(response, 400, None, "runner='generate'")
    finally:
        server.stop()
        engine.shutdown()


QUERY = "Which fox is red?"
DOCUMENTS = TEXTS[:6]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_is_the_cosine_of_embeddings(served: Served) -> None:
    one = httpx.post(served.url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS},
                     timeout=TIMEOUT_S).json()
    query = served.expected(QUERY)
    assert [d["index"] for d in one["data"]] == list(range(len(DOCUMENTS)))
    for d, doc in zip(one["data"], DOCUMENTS, strict=True):
        assert d["object"] == "score"
        assert d["score"] == pytest.approx(cosine(query, served.expected(doc)), abs=ATOL)
    pairwise = httpx.post(served.url + "/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:4]},
                          timeout=TIMEOUT_S).json()
    for d, (a, b) in zip(pairwise["data"], [(0, 2), (1, 3)], strict=True):
        assert d["score"] == pytest.approx(
            cosine(served.expected(TEXTS[a]), served.expected(TEXTS[b])), abs=ATOL)
    assert one["usage"]["prompt_tokens"] == sum(len(served.ids(t)) for t in [QUERY, *DOCUMENTS])


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_in_jina_and_cohere_shape(served: Served, path: str) -> None:
    expected = [cosine(served.expected(QUERY), served.expected(d)) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    out = httpx.post(served.url + path, json=body, timeout=TIMEOUT_S).json()
    assert [r["index"] for r in out["results"]] == order[:3]
    for r in out["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=ATOL)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    bare = httpx.post(served.url + path, json={**body, "top_n": 0, "return_documents": False},
                      timeout=TIMEOUT_S).json()
    assert [r["index"] for r in bare["results"]] == order
    assert all("document" not in r for r in bare["results"])


def test_bad_score_and_rerank_requests(served: Served) -> None:
    def post_to(path: str, body: Any) -> httpx.Response:
        return httpx.post(served.url + path, json=body, timeout=TIMEOUT_S)

    assert_error(post_to("/v1/rerank", {"query": "q", "documents": []}), 400, "documents", "empty")
    assert_error(post_to("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}), 400, "top_n")
    assert_error(post_to("/v1/rerank", {"query": "q", "documents": ["a", " word" * 400]}), 400,
                 "documents", "maximum context length")
    assert_error(post_to("/v1/rerank", {"query": "", "documents": ["a"]}), 400, "query", "empty")
    assert_error(post_to("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400, "text_1")
    assert_error(post_to("/score", {"text_1": [], "text_2": "c"}), 400, "text_1")
    assert_error(post_to("/rerank", {"query": "q", "documents": ["a"], "model": "other"}), 404, "model")
    assert_error(post_to("/v2/rerank", {"query": "q"}), 400, "documents")
    stats = served.engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_the_key_guards_scoring_routes(served: Served) -> None:
    keyed = ServerThread(build_app(served.engine, ServerConfig(api_key="k"))).start()
    try:
        for path, body in [("/v1/embeddings", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]}),
                           ("/v2/rerank", {"query": "a", "documents": ["b"]})]:
            refused = httpx.post(keyed.url + path, json=body, timeout=TIMEOUT_S)
            assert refused.status_code == 401, path
            ok = httpx.post(keyed.url + path, json=body, headers={"Authorization": "Bearer k"},
                            timeout=TIMEOUT_S)
            assert ok.status_code == 200, (path, ok.text)
    finally:
        keyed.stop()
