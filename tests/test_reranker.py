"""A causal LM served as a yes/no reranker (vLLM's hf_overrides for
Qwen3-Reranker): a pair's score is the 2-way softmax's "yes" probability over
the last-row logits of the "no" and "yes" tokens, as transformers computes it
from the causal LM, within 1e-5 (float32): offline (LLM.score) and through
/score, /v1/score and the three /rerank routes on a live server, on a tiny
random Qwen3 with a real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
import transformers

from tests.qwen3_chat import save_qwen3_chat_model
from tests.server_harness import ServerThread
from tokenmill import LLM
from tokenmill.config import ModelConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server import build_app

TIMEOUT_S = 60.0
ATOL = 1e-5
MODEL = "tiny-reranker"
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
             "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
QUERY = "What is the capital of China?"
DOCUMENTS = ["The capital of China is Beijing.", "Gravity attracts two bodies.",
             "Paris is in France.", "Beijing hosts the government.", "A fox jumps."]
# vLLM's examples/offline_inference/qwen3_reranker.py, written out here so that
# a wrong template in tokenmill fails the test.
PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the '
          'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
          '<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def formatted_query(query: str) -> str:
    return f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {query}\n"


def formatted_document(document: str) -> str:
    return f"<Document>: {document}{SUFFIX}"


@dataclass
class Served:
    llm: LLM
    hf: Any
    engine: AsyncEngine
    server: ServerThread

    def ids(self, text: str) -> list[int]:
        return self.llm.get_tokenizer().encode(text)

    def expected_ids(self, ids: list[int]) -> float:
        """transformers: the causal LM's last-row logits of "no" and "yes", 2-way softmax."""
        tokenizer = self.llm.get_tokenizer()
        no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("no", "yes"))
        with torch.no_grad():
            logits = self.hf(torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits[[no, yes]].double(), dim=0)[1])

    def expected(self, query: str, document: str) -> float:
        return self.expected_ids(self.ids(formatted_query(query) + formatted_document(document)))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = save_qwen3_chat_model(tmp_path_factory.mktemp("qwen3-reranker"), think_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    llm = LLM(model=path, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512,
              hf_overrides=OVERRIDES, apply_process_settings=False)
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(served_model_name=MODEL))).start()
    try:
        yield Served(llm, hf, engine, server)
    finally:
        server.stop()
        engine.shutdown()


def test_llm_score_is_the_yes_probability(served: Served) -> None:
    expected = [served.expected(QUERY, d) for d in DOCUMENTS]
    assert max(expected) - min(expected) > 1e-4  # (the documents score apart)
    out = served.llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert [o.outputs.score for o in out] == pytest.approx(expected, abs=ATOL)
    # Texts formatted by the client, as vLLM's example sends them, are only concatenated.
    pre = served.llm.score(formatted_query(QUERY), [formatted_document(d) for d in DOCUMENTS],
                           use_tqdm=False)
    assert [o.outputs.score for o in pre] == pytest.approx(expected, abs=ATOL)
    # Token-id prompts: the two concatenated.
    first, second = served.ids("a question"), served.ids(" an answer")
    ids_out = served.llm.score({"prompt_token_ids": first}, {"prompt_token_ids": second}, use_tqdm=False)
    assert ids_out[0].outputs.score == pytest.approx(served.expected_ids(first + second), abs=ATOL)


def test_a_reranker_does_not_embed(served: Served) -> None:
    with pytest.raises(ValueError, match="reranker"):
        served.llm.embed("a text", use_tqdm=False)
    response = httpx.post(served.server.url + "/v1/embeddings", json={"input": "a"}, timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    assert "/rerank" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_route(served: Served, path: str) -> None:
    out = httpx.post(served.server.url + path, json={"text_1": QUERY, "text_2": DOCUMENTS},
                     timeout=TIMEOUT_S).json()
    assert [d["index"] for d in out["data"]] == list(range(len(DOCUMENTS)))
    for d, doc in zip(out["data"], DOCUMENTS, strict=True):
        assert d["score"] == pytest.approx(served.expected(QUERY, doc), abs=ATOL)
    prompts = [formatted_query(QUERY) + formatted_document(d) for d in DOCUMENTS]
    assert out["usage"]["prompt_tokens"] == sum(len(served.ids(p)) for p in prompts)
    pairwise = httpx.post(served.server.url + path, json={"text_1": ["q1", "q2"], "text_2": ["d1", "d2"]},
                          timeout=TIMEOUT_S).json()
    for d, (q, doc) in zip(pairwise["data"], [("q1", "d1"), ("q2", "d2")], strict=True):
        assert d["score"] == pytest.approx(served.expected(q, doc), abs=ATOL)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_routes(served: Served, path: str) -> None:
    expected = [served.expected(QUERY, d) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    out = httpx.post(served.server.url + path, json=body, timeout=TIMEOUT_S).json()
    assert [r["index"] for r in out["results"]] == order[:2]
    for r in out["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=ATOL)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    bare = httpx.post(served.server.url + path, json={**body, "top_n": 0, "return_documents": False},
                      timeout=TIMEOUT_S).json()
    assert [r["index"] for r in bare["results"]] == order
    assert all("document" not in r for r in bare["results"])
    empty = httpx.post(served.server.url + path, json={"query": QUERY, "documents": [""]},
                       timeout=TIMEOUT_S)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


def test_bad_hf_overrides(served: Served, tmp_path_factory: pytest.TempPathFactory) -> None:
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig(model="m", hf_overrides={**OVERRIDES, "rope_scaling": {}})
    with pytest.raises(ValueError, match="classifier_from_token"):
        ModelConfig(model="m", hf_overrides={"classifier_from_token": ["yes"]})
    path = served.llm.engine.source.path
    with pytest.raises(ValueError, match="exactly one"):
        LLM(model=path, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=64,
            hf_overrides={**OVERRIDES, "classifier_from_token": ["no", "definitely not yes"]},
            apply_process_settings=False)
    with pytest.raises(ValueError, match="runner='generate'"):
        LLM(model=path, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=64,
            hf_overrides=OVERRIDES, runner="generate", apply_process_settings=False)
