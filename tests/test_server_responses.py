"""/v1/responses through real HTTP with the official `openai` client, on the
default model (float32). Greedy outputs are checked against offline chat
generation on the same engine (the same messages through the chat template),
run before the server starts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.server_harness import ServerThread
from tokenmill import LLM, SamplingParams
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server import build_app

TIMEOUT_S = 60.0
MAX_TOKENS = 12
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And of Italy?"
INSTRUCTIONS = "Answer in one word."
STORE_CAPACITY = 2


@dataclass
class Served:
    llm: LLM
    main: ServerThread
    small: ServerThread  # max_stored_responses=STORE_CAPACITY
    expected: dict[str, Any]

    def client(self, server: ServerThread | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(server or self.main).url + "/v1", api_key="unused",
                             timeout=TIMEOUT_S, max_retries=0)


def _chat(llm: LLM, messages: list[dict[str, str]]) -> Any:
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20)
    first = _chat(llm, [{"role": "user", "content": QUESTION}])
    expected = {
        "plain": first,
        "instructed": _chat(llm, [{"role": "system", "content": INSTRUCTIONS},
                                  {"role": "user", "content": QUESTION}]),
        # The follow-up's conversation: the first turn, its answer, the new input.
        "follow_up": _chat(llm, [{"role": "user", "content": QUESTION},
                                 {"role": "assistant", "content": first.outputs[0].text},
                                 {"role": "user", "content": FOLLOW_UP}]),
    }
    engine = AsyncEngine(llm.engine)
    main = ServerThread(build_app(engine, ServerConfig())).start()
    small = ServerThread(build_app(engine, ServerConfig(max_stored_responses=STORE_CAPACITY))).start()
    try:
        yield Served(llm, main, small, expected)
    finally:
        main.stop()
        small.stop()
        engine.shutdown()


def test_create_matches_offline_chat(served: Served) -> None:
    expected = served.expected["plain"]
    response = served.client().responses.create(
        input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0,
    )
    assert response.object == "response"
    assert response.id.startswith("resp")
    assert response.output_text == expected.outputs[0].text
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage is not None
    assert response.usage.input_tokens == len(expected.prompt_token_ids)
    assert response.usage.output_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    finish = expected.outputs[0].finish_reason
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"


def test_vllm_sampling_extras_apply(served: Served) -> None:
    # `vllm bench serve --ignore-eos` sends vLLM's ignore_eos to /v1/responses.
    response = served.client().responses.create(
        input=QUESTION, max_output_tokens=40, temperature=0, extra_body={"ignore_eos": True},
    )
    assert response.usage is not None and response.usage.output_tokens == 40
    assert response.status == "incomplete"


def test_message_list_and_instructions(served: Served) -> None:
    expected = served.expected["instructed"]
    response = served.client().responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        instructions=INSTRUCTIONS, max_output_tokens=MAX_TOKENS, temperature=0,
    )
    assert response.output_text == expected.outputs[0].text
    assert response.instructions == INSTRUCTIONS
    assert response.usage is not None
    assert response.usage.input_tokens == len(expected.prompt_token_ids)


def test_stream_event_sequence(served: Served) -> None:
    expected = served.expected["plain"]
    events = list(served.client().responses.create(
        input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0, stream=True,
    ))
    kinds = [e.type for e in events]
    last = "response.incomplete" if expected.outputs[0].finish_reason == "length" else "response.completed"
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", last]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected.outputs[0].text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text
    assert final.usage is not None
    assert final.usage.input_tokens == len(expected.prompt_token_ids)
    assert final.usage.output_tokens == len(expected.outputs[0].token_ids)
    # The stored response is the final one.
    stored = served.client().responses.retrieve(final.id)
    assert stored.output_text == text


def test_previous_response_id_continues_the_conversation(served: Served) -> None:
    client = served.client()
    first = client.responses.create(input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0,
                                    instructions=INSTRUCTIONS)
    # The instructions hold for the first response only (OpenAI's rule).
    second = client.responses.create(input=FOLLOW_UP, previous_response_id=first.id,
                                     max_output_tokens=MAX_TOKENS, temperature=0)
    expected = served.expected["follow_up"]
    assert second.previous_response_id == first.id
    assert second.output_text == expected.outputs[0].text
    assert second.usage is not None
    assert second.usage.input_tokens == len(expected.prompt_token_ids)


def test_store_is_bounded_and_store_false_keeps_nothing(served: Served) -> None:
    client = served.client(served.small)
    ids = [client.responses.create(input=f"Say {i}.", max_output_tokens=2, temperature=0).id
           for i in range(STORE_CAPACITY + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the least recently used one went
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(input="Go on.", previous_response_id=ids[0], max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for response_id in ids[1:]:
        assert client.responses.retrieve(response_id).id == response_id
    unstored = client.responses.create(input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 10**7}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text"),
    ({"input": "hi", "model": "no-such-model"}, "model"),
])
def test_bad_requests_name_the_field(served: Served, body: dict[str, Any], param: str) -> None:
    r = httpx.post(served.main.url + "/v1/responses", json=body, timeout=TIMEOUT_S)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_ids_are_404(served: Served) -> None:
    r = httpx.get(served.main.url + "/v1/responses/resp-nope", timeout=TIMEOUT_S)
    assert r.status_code == 404
    r = httpx.post(served.main.url + "/v1/responses", timeout=TIMEOUT_S,
                   json={"input": "hi", "previous_response_id": "resp-nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
