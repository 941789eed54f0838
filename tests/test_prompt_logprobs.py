"""Prompt logprobs through the server, over real HTTP: `echo` + `logprobs` in
OpenAI's legacy shape (what lm-evaluation-harness scores with), vLLM's
`prompt_logprobs` field, and vLLM's 404 for an unknown model.

The model is a tiny random Llama (float32) with the default model's tokenizer
saved beside it, so tokens have text; transformers on the same weights is the
oracle. Prefix caching is on, prefill is chunked, and the scored prompts were
served once before (their blocks are cached): a request for prompt logprobs
must still compute every position."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from tests.hf_models import COMMON
from tests.server_harness import ServerThread
from tokenmill import LLM
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.model.source import resolve_model_source
from tokenmill.server import build_app
from tokenmill.tokenizer import Tokenizer

TIMEOUT_S = 60.0
MODEL = "tiny"
PROMPT = ("The quick brown fox jumps over the lazy dog. " * 6).strip()  # ~60 tokens: 4 chunks
CHAT = [{"role": "user", "content": "Say something about foxes."}]


@dataclass
class Served:
    hf: torch.nn.Module
    engine: AsyncEngine
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                             max_retries=0)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=TIMEOUT_S)

    def tokens(self, text: str) -> list[int]:
        return list(self.post("/tokenize", {"prompt": text}).json()["tokens"])

    def prefix_hits(self) -> int:
        return self.engine.stats().prefix_cache_hits


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = Tokenizer.load(resolve_model_source(None).path).hf
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, block_size=16,
              max_num_batched_tokens=16, kv_cache_memory_bytes=16 << 20)
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(served_model_name=MODEL))).start()
    try:
        yield Served(hf, engine, server)
    finally:
        server.stop()
        engine.shutdown()


@torch.inference_mode()
def hf_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row p is transformers' log_softmax predicting token p + 1."""
    logits = model(torch.tensor([tokens])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def warm(served: Served, prompt: Any) -> None:
    """Serve `prompt` plainly twice: its blocks are cached, and the second run hits them."""
    before = served.prefix_hits()
    for _ in range(2):
        served.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert served.prefix_hits() > before, "the prefix cache should serve a repeated prompt"


def token_text(served: Served, token_id: int) -> str:
    return str(served.engine.decode([token_id], False))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_transformers_with_a_cached_prompt(served: Served, max_tokens: int) -> None:
    ids = served.tokens(PROMPT)
    warm(served, PROMPT)
    hits = served.prefix_hits()
    body = served.post("/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
        "temperature": 0,
    }).json()
    assert served.prefix_hits() == hits, "a prompt-logprobs request must not take prefix hits"
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    ref = hf_logprobs(served.hf, ids)
    num = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == num
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][: len(ids)] == [token_text(served, t) for t in ids]
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < 1e-4, f"position {p}"
        top = lp["top_logprobs"][p]
        best = int(ref[p - 1].argmax())
        assert abs(top[token_text(served, best)] - ref[p - 1, best].item()) < 1e-4
        assert lp["tokens"][p] in top and len(top) <= 2  # the token itself and the top 1
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    assert choice["finish_reason"] == "length"
    if max_tokens == 0:
        assert choice["text"] == PROMPT
        assert body["usage"]["completion_tokens"] == 0
    else:
        greedy = int(ref[-1].argmax())
        assert choice["text"] == PROMPT + served.engine.decode([greedy])
        assert lp["tokens"][-1] == token_text(served, greedy)
        assert abs(lp["token_logprobs"][-1] - ref[-1, greedy].item()) < 1e-4
        assert body["usage"]["completion_tokens"] == 1
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_openai_client_scores_token_prompts_as_lm_eval_does(served: Served) -> None:
    """lm-evaluation-harness' local-completions: token-id prompts in a batch, echo,
    logprobs=1, max_tokens 0 (or 1), greedy."""
    context = served.tokens(PROMPT + " Question: which animal is quick? Answer:")
    prompts = [context + served.tokens(" the fox"), context + served.tokens(" the dog")]
    warm(served, prompts[0])
    out = served.client().completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    for choice, prompt in zip(out.choices, prompts, strict=True):
        assert choice.logprobs is not None
        token_logprobs = choice.logprobs.token_logprobs
        assert token_logprobs is not None and len(token_logprobs) == len(prompt)
        assert token_logprobs[0] is None
        ref = hf_logprobs(served.hf, prompt)
        got = sum(token_logprobs[len(context):])  # type: ignore[arg-type]
        want = sum(ref[p - 1, prompt[p]].item() for p in range(len(context), len(prompt)))
        assert abs(got - want) < 1e-4


def test_streamed_echo_logprobs_equal_the_whole_answer(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3,
            "temperature": 0}
    whole = served.post("/v1/completions", body).json()["choices"][0]
    text = ""
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True},
                      timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[len("data: "):])["choices"]
            text += choice["text"]
            for name in merged:
                merged[name].extend((choice["logprobs"] or {}).get(name, []))
    assert text == whole["text"]
    assert merged == whole["logprobs"]


def test_streamed_echo_of_the_prompt_alone(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", served.url + "/v1/completions", json=body,
                      timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    *texts, usage = chunks
    (only,) = [c["choices"][0] for c in texts]
    assert only["text"] == PROMPT and only["finish_reason"] == "length"
    assert len(only["logprobs"]["tokens"]) == len(served.tokens(PROMPT))
    assert usage["usage"]["completion_tokens"] == 0


def test_echo_logprobs_with_n_samples(served: Served) -> None:
    body = served.post("/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 2, "n": 2,
        "temperature": 1.0, "seed": 3,
    }).json()
    num = len(served.tokens(PROMPT))
    prompts = [c["logprobs"]["token_logprobs"][:num] for c in body["choices"]]
    assert len(prompts) == 2 and prompts[0] == prompts[1] and prompts[0][0] is None
    assert all(len(c["logprobs"]["tokens"]) == num + 2 for c in body["choices"])


def test_vllm_prompt_logprobs_field_on_both_endpoints(served: Served) -> None:
    ids = served.tokens(PROMPT)
    ref = hf_logprobs(served.hf, ids)
    body = served.post("/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1}).json()
    (choice,) = body["choices"]
    assert choice["logprobs"] is None and choice["text"] != PROMPT
    field = choice["prompt_logprobs"]
    assert len(field) == len(ids) and field[0] is None
    for p in range(1, len(ids)):
        entry = field[p]
        assert abs(entry[str(ids[p])]["logprob"] - ref[p - 1, ids[p]].item()) < 1e-4
        top = ref[p - 1].topk(2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-4 and entry[str(t)]["rank"] == rank
            assert entry[str(t)]["decoded_token"] == token_text(served, t)

    chat = served.post("/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "prompt_logprobs": 0, "max_tokens": 2}).json()
    chat_ids = served.post("/tokenize", {"messages": CHAT}).json()["tokens"]
    chat_ref = hf_logprobs(served.hf, chat_ids)
    field = chat["prompt_logprobs"]
    assert len(field) == len(chat_ids) and field[0] is None
    for p in range(1, len(chat_ids)):
        got = field[p][str(chat_ids[p])]["logprob"]
        assert math.isclose(got, chat_ref[p - 1, chat_ids[p]].item(), abs_tol=1e-4)
    assert served.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).json().get(
        "prompt_logprobs") is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_with_prompt_logprobs_is_400(served: Served, path: str) -> None:
    body = {"prompt": PROMPT, "messages": CHAT, "prompt_logprobs": 1, "stream": True}
    response = served.post(path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/tokenize", {"prompt": "hi"}),
])
def test_unknown_model_is_404_not_found(served: Served, path: str, body: dict[str, Any]) -> None:
    response = served.post(path, {**body, "model": "no-such-model"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["type"] == "NotFoundError" and error["code"] == 404
    assert "no-such-model" in error["message"]


def test_openai_client_sees_not_found(served: Served) -> None:
    with pytest.raises(openai.NotFoundError):
        served.client().completions.create(model="no-such-model", prompt="hi", max_tokens=1)


def test_models_list_reports_max_model_len_and_root(served: Served) -> None:
    body = httpx.get(served.url + "/v1/models", timeout=TIMEOUT_S).json()
    (card,) = body["data"]
    assert card["id"] == MODEL
    assert card["max_model_len"] == served.engine.facts.max_model_len == COMMON["max_position_embeddings"]
    assert Path(card["root"]).is_dir()  # the weights' own path, under the served name
    assert card["object"] == "model" and card["owned_by"] == "tokenmill"
