"""Reasoning output (--reasoning-parser): the parsers at every split of their
text, the grammar that waits for the end of the thinking, and a tiny random
Qwen3 with Qwen3's chat template served end to end (its output steered by a
regex to contain <think>...</think>), streamed and whole, chat and Responses."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.qwen3_chat import Qwen3Served, save_qwen3_chat_model, serve_qwen3
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.server.reasoning import ReasoningDelta, ReasoningParser

TIMEOUT_S = 120.0
OPEN = "<|im_start|>assistant\n<think>\n"  # a prompt that leaves the thinking open
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=false

# (parser, the prompt's text, the answer, (reasoning, content))
CASES: list[tuple[str, str | None, str, tuple[str, str]]] = [
    ("qwen3", None, "<think>\nLet me see.\n</think>\n\nHello!", ("\nLet me see.\n", "\n\nHello!")),
    ("qwen3", None, "\n<think>a</think>b", ("a", "b")),
    ("qwen3", None, "No thinking here.", ("", "No thinking here.")),
    ("qwen3", None, "<thinking> is not a tag", ("", "<thinking> is not a tag")),
    ("qwen3", None, "a </think> b", ("", "a </think> b")),
    ("qwen3", None, "less <th", ("", "less <th")),
    ("qwen3", None, "<think>cut short by max_tokens", ("cut short by max_tokens", "")),
    ("qwen3", None, "<think>x </thin y</think>z</think>", ("x </thin y", "z</think>")),
    ("qwen3", OPEN, "thought</think>answer", ("thought", "answer")),
    ("qwen3", OPEN, "still thinking", ("still thinking", "")),
    ("qwen3", CLOSED, "<think>x</think>y", ("", "<think>x</think>y")),
    ("deepseek_r1", None, "thought</think>answer", ("thought", "answer")),
    ("deepseek_r1", None, "<think>thought</think>answer", ("thought", "answer")),
    ("deepseek_r1", None, "only thought", ("only thought", "")),
    ("deepseek_r1", CLOSED, "answer", ("", "answer")),
]


def streamed(name: str, prompt: str | None, pieces: list[str]) -> ReasoningDelta:
    parser = ReasoningParser(name, prompt)
    out = ReasoningDelta()
    for piece in pieces:
        delta = parser.feed(piece)
        out.reasoning += delta.reasoning
        out.content += delta.content
    rest = parser.finish()
    return ReasoningDelta(out.reasoning + rest.reasoning, out.content + rest.content)


@pytest.mark.parametrize(("name", "prompt", "text", "expected"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_whole_and_streamed_at_every_split(name: str, prompt: str | None, text: str,
                                                  expected: tuple[str, str]) -> None:
    want = ReasoningDelta(*expected)
    assert ReasoningParser(name, prompt).parse(text) == want
    for cut in range(len(text) + 1):  # the tag split at every place between two deltas
        assert streamed(name, prompt, [text[:cut], text[cut:]]) == want, cut
    for a in range(len(text) + 1):
        for b in range(a, min(a + 9, len(text) + 1)):  # a tag inside the middle delta
            assert streamed(name, prompt, [text[:a], text[a:b], text[b:]]) == want, (a, b)
    assert streamed(name, prompt, list(text)) == want


def test_parser_sends_thinking_as_it_comes() -> None:
    parser = ReasoningParser("qwen3")
    assert parser.feed("<thi") == ReasoningDelta()  # (maybe the tag: held)
    assert parser.feed("nk>Hmm, ") == ReasoningDelta(reasoning="Hmm, ")
    assert parser.feed("yes</th") == ReasoningDelta(reasoning="yes")
    assert not parser.reasoning_ended
    assert parser.feed("ink>\n\nIt") == ReasoningDelta(content="\n\nIt")
    assert parser.reasoning_ended
    assert parser.finish() == ReasoningDelta()


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParser("granite")


# ---- the grammar waits for the end of the thinking ------------------------------------------


@pytest.fixture(scope="module")
def split_tags_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3 whose tokenizer writes <think> and </think> in pieces."""
    return save_qwen3_chat_model(tmp_path_factory.mktemp("qwen3-split"), think_tokens=False)


def test_grammar_holds_only_after_the_reasoning_end_token(split_tags_dir: str) -> None:
    """Greedy tokens before the end token are the unconstrained model's own
    (nothing masked, the matcher not advanced); the rest is held to the grammar."""
    llm = LLM(model=split_tags_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)
    try:
        prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)[0].outputs[0].token_ids
        k = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # first seen at k
        choice = ["yes", "no"]

        def run(end: int | None) -> tuple[list[int], str]:
            params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=(
                StructuredOutputsParams(choice=choice, reasoning_end_token_id=end)))
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            return list(out.token_ids), out.text

        tokens, _ = run(free[k])
        assert tokens[: k + 1] == free[: k + 1]
        tokenizer = llm.get_tokenizer()
        assert tokenizer.decode(tokens[k + 1 :]) in choice
        assert run(None)[1] in choice  # (held from the first token)
    finally:
        llm.engine.shutdown()


# ---- served ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split_tags(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Qwen3Served]:
    served = serve_qwen3(tmp_path_factory.mktemp("qwen3-split-served"), think_tokens=False)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Qwen3Served]:
    served = serve_qwen3(tmp_path_factory.mktemp("qwen3-served"), think_tokens=True)
    try:
        yield served
    finally:
        served.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def model_id(served: Qwen3Served) -> str:
    return client(served.server.url).models.list().data[0].id


CHAT = [{"role": "user", "content": "Is 7 prime?"}]
# The answer steered into thinking and content. With </think> in several tokens the
# grammar cannot wait for it (serving.hold_constraint_after_thinking), so it holds
# the whole text, tags included.
STEER = {"structured_outputs": {"regex": r"<think>[a-z ]{6,24}</think>[a-z ]{6,24}"}}


def stream_chat(url: str, **kwargs: Any) -> tuple[list[dict[str, Any]], str | None]:
    deltas, reason = [], None
    for chunk in client(url).chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            deltas.append(choice.delta.model_dump())
            reason = choice.finish_reason or reason
    return deltas, reason


def test_chat_splits_thinking_streamed_and_whole(split_tags: Qwen3Served) -> None:
    kwargs: dict[str, Any] = {"model": model_id(split_tags), "messages": CHAT, "max_tokens": 80,
                              "temperature": 0, "extra_body": STEER}
    raw = client(split_tags.plain.url).chat.completions.create(**kwargs).choices[0].message.content
    assert raw is not None
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", raw, re.DOTALL).groups()  # type: ignore[union-attr]
    # The raw stream: the closing tag comes in several chunks (a tag across chunks).
    raw_pieces = [d["content"] or "" for d in stream_chat(split_tags.plain.url, **kwargs)[0]]
    assert "".join(raw_pieces) == raw
    assert not any("</think>" in piece for piece in raw_pieces)

    message = client(split_tags.server.url).chat.completions.create(**kwargs).choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == thought
    assert message.content == answer

    deltas, reason = stream_chat(split_tags.server.url, **kwargs)
    assert reason == "stop"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])


def responses_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True},
                      timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events


def test_responses_reasoning_items_streamed_and_whole(qwen3: Qwen3Served) -> None:
    # A template that opens <think> in the prompt (open_think, through
    # chat_template_kwargs): all of a short answer is thinking.
    body = {"input": "Is 7 prime?", "max_output_tokens": 8, "temperature": 0,
            "chat_template_kwargs": {"open_think": True}}
    whole = httpx.post(qwen3.server.url + "/v1/responses", json=body, timeout=TIMEOUT_S).json()
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and message["type"] == "message"
    thought = reasoning["content"][0]["text"]
    assert thought and message["content"][0]["text"] == ""
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 8

    events = responses_events(qwen3.server.url, body)
    kinds = [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "reasoning"), (1, "message")]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == thought
    # The openai SDK reads it too.
    sdk = client(qwen3.server.url).responses.create(
        model=model_id(qwen3), input="Is 7 prime?", max_output_tokens=8,
        temperature=0, extra_body={"chat_template_kwargs": {"open_think": True}})
    assert sdk.output[0].type == "reasoning"


def test_enable_thinking_false_reaches_the_template(qwen3: Qwen3Served) -> None:
    def prompt(**extra: Any) -> str:
        tokens = httpx.post(qwen3.server.url + "/tokenize", json={"messages": CHAT, **extra},
                            timeout=TIMEOUT_S).json()["tokens"]
        return httpx.post(qwen3.server.url + "/detokenize", json={"tokens": tokens},
                          timeout=TIMEOUT_S).json()["prompt"]

    assert prompt().endswith("<|im_start|>assistant\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # On chat: the prompt's token count says the empty think block is there.
    def usage(**extra: Any) -> int:
        response = client(qwen3.server.url).chat.completions.create(
            model=model_id(qwen3), messages=CHAT, max_tokens=1, extra_body=extra)
        assert response.usage is not None
        return response.usage.prompt_tokens

    assert usage(chat_template_kwargs={"enable_thinking": False}) == usage() + len(
        qwen3.llm.get_tokenizer().encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    bad = httpx.post(qwen3.server.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


SCHEMA = {"type": "object", "properties": {"prime": {"type": "boolean"}}, "required": ["prime"]}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_holds_the_answer_after_thinking(qwen3: Qwen3Served, stream: bool) -> None:
    """Thinking off (the prompt closes it): the grammar holds from the first
    token, and the answer is content; thinking on, the grammar waits for
    </think> (one token here), which this random model does not write."""
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
            "chat_template_kwargs": {"enable_thinking": False}}
    if stream:
        deltas, _ = stream_chat(qwen3.server.url, model=model_id(qwen3),
                                **{k: v for k, v in body.items() if k in ("messages", "max_tokens",
                                                                         "temperature", "response_format")},
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        content = "".join(d.get("content") or "" for d in deltas)
        assert not any(d.get("reasoning_content") for d in deltas)
    else:
        message = httpx.post(qwen3.server.url + "/v1/chat/completions", json=body,
                             timeout=TIMEOUT_S).json()["choices"][0]["message"]
        assert message["reasoning_content"] is None
        content = message["content"]
    jsonschema.validate(json.loads(content), SCHEMA)
    # Thinking on: nothing held yet, so the random text is no JSON object.
    free = httpx.post(qwen3.server.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        **body, "chat_template_kwargs": {}, "max_tokens": 6}).json()["choices"][0]["message"]
    assert not (free["content"] or "").lstrip().startswith("{")


def test_unknown_fields_are_logged_once(qwen3: Qwen3Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tokenmill")
    for _ in range(2):
        response = httpx.post(qwen3.server.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
            "messages": CHAT, "max_tokens": 1, "frobnicate_reasoning_test": True})
        assert response.status_code == 200
    logged = [r for r in caplog.records if "frobnicate_reasoning_test" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.DEBUG
