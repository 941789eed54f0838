"""Tool calling: the output parsers (streamed and whole alike), the request's
tools and tool_choice, the chat template with tools, and the server end to end
on a tiny random model (tokenizer and chat template of the default model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers

from tests.hf_models import COMMON
from tests.server_harness import ServerThread
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.model.source import resolve_model_source
from tokenmill.server import build_app
from tokenmill.server.errors import APIError
from tokenmill.server.tool_parsers import (
    CallArguments,
    CallStart,
    Content,
    Event,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    ParsedCall,
    ParsedMessage,
    RequiredToolParser,
    ToolParser,
    collect,
)
from tokenmill.server.tools import ToolPlan, ToolStream, plan_tools, required_schema, template_uses
from tokenmill.server.tools import whole_message as server_whole_message
from tokenmill.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
HERMES_TEMPLATE = (REPO / "examples" / "tool_chat_template_hermes.jinja").read_text()
TIMEOUT_S = 120.0

# ---- parsers ---------------------------------------------------------------------------------

ARGS = '{"city": "Paris", "days": [1, 2], "note": "a } and a \\" and <tool_call>"}'

# (parser, text, the message it is)
CASES: list[tuple[str, str, ParsedMessage]] = [
    ("hermes", "Just text, no call.", ParsedMessage("Just text, no call.")),
    ("hermes", "Let me look. <tool_call>\n" '{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call>",
     ParsedMessage("Let me look. ", [ParsedCall("get_weather", ARGS)])),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>\n<tool_call>{"name": "g"}'
     "</tool_call> done",
     ParsedMessage("\n done", [ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")])),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as a string
     ParsedMessage("", [ParsedCall("f", '{"x": 1}')])),
    ("hermes", "a <tool_call>not json</tool_call> b", ParsedMessage("a <tool_call>not json</tool_call> b")),
    ("hermes", 'a <tool_call>{"nom": 1}</tool_call>', ParsedMessage('a <tool_call>{"nom": 1}</tool_call>')),
    ("hermes", "less < than <tool_cal", ParsedMessage("less < than <tool_cal")),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1', ParsedMessage("", [ParsedCall("f", '{"x": [1')])),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": ' + ARGS + '}; {"name": "g", "arguments": {}}',
     ParsedMessage("", [ParsedCall("f", ARGS), ParsedCall("g", "{}")])),
    ("llama3_json", ' {"name": "f", "parameters": {"x": 1.5e3, "y": null}}',
     ParsedMessage("", [ParsedCall("f", '{"x": 1.5e3, "y": null}')])),
    ("llama3_json", "The answer is 4.", ParsedMessage("The answer is 4.")),
    ("llama3_json", ' {"x": 1} tail', ParsedMessage(' {"x": 1} tail')),
    ("llama3_json", '{"name": "f", "parameters": {}} and then', ParsedMessage(" and then", [ParsedCall("f", "{}")])),
    ("required", '[{"name": "f", "parameters": ' + ARGS + '}, {"name": "g", "parameters": {"n": -2}}]',
     ParsedMessage("", [ParsedCall("f", ARGS), ParsedCall("g", '{"n": -2}')])),
    ("required", ' [ { "name" : "f" , "parameters" : { } } ] ', ParsedMessage("", [ParsedCall("f", "{ }")])),
    ("required", "no array", ParsedMessage("no array")),
    ("named", ARGS, ParsedMessage("", [ParsedCall("f", ARGS)])),
]


def make_parser(kind: str) -> ToolParser:
    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
            "required": RequiredToolParser, "named": lambda: NamedToolParser("f")}[kind]()


def streamed(kind: str, pieces: list[str]) -> tuple[ParsedMessage, list[Event]]:
    parser = make_parser(kind)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return collect(events), events


@pytest.mark.parametrize(("kind", "text", "expected"), CASES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(CASES)])
def test_parser_whole_and_streamed_at_every_split(kind: str, text: str, expected: ParsedMessage) -> None:
    assert make_parser(kind).parse(text) == expected
    for cut in range(len(text) + 1):
        assert streamed(kind, [text[:cut], text[cut:]])[0] == expected, cut
    # One character at a time: each call's name comes before its arguments, once.
    message, events = streamed(kind, list(text))
    assert message == expected
    starts = [e.index for e in events if isinstance(e, CallStart)]
    assert starts == list(range(len(expected.calls)))
    for e in events:
        if isinstance(e, CallArguments):
            assert e.index in starts[: e.index + 1]


def test_streamed_arguments_arrive_in_pieces_and_tags_are_held() -> None:
    parser = HermesToolParser()
    assert parser.feed("Hi <tool") == [Content("Hi ")]  # (maybe a tag: held)
    assert parser.feed('_call>{"name": "f", "argu') == [CallStart(0, "f")]
    assert parser.feed('ments": {"a": 1') == [CallArguments(0, '{"a": 1')]
    assert parser.feed(', "b": 2}}</tool_call>') == [CallArguments(0, ', "b": 2}')]
    assert parser.finish() == []


def test_tool_stream_chunks_merge_as_openai_clients_merge_them() -> None:
    """The chat endpoint's deltas for a hermes answer, serialized and merged by
    the openai client's own accumulator, give the non-streamed message."""
    from openai.lib.streaming._deltas import accumulate_delta

    from tokenmill.server.protocol import DeltaMessage

    text = ('Checking. <tool_call>{"name": "get_weather", "arguments": ' + ARGS + '}</tool_call>\n'
            '<tool_call>{"name": "set_alarm", "arguments": {"hour": 7}}</tool_call>')
    for parallel in (True, False):
        plan = ToolPlan([], "auto", parser="hermes", parallel=parallel)
        stream, merged = ToolStream(plan), {}
        for i in range(0, len(text), 3):
            content, calls = stream.feed(text[i : i + 3], final=i + 3 >= len(text))
            delta = json.loads(DeltaMessage(content=content, tool_calls=calls).model_dump_json())
            for call in delta["tool_calls"] or []:
                assert None not in call.values() and None not in call.get("function", {}).values()
            merged = accumulate_delta(merged, {k: v for k, v in delta.items() if v is not None})
        whole = server_whole_message(plan, text)
        assert merged["content"] == whole.content == "Checking. \n"
        assert [(c["type"], c["function"]) for c in merged["tool_calls"]] == [
            ("function", c.function.model_dump()) for c in whole.tool_calls]
        assert len(whole.tool_calls) == (2 if parallel else 1) and stream.called


def test_plan_defaults() -> None:
    """tool_choice defaults to "auto" with tools (OpenAI's and vLLM's default)."""
    from tokenmill.server.protocol import ChatCompletionRequest

    auto = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    plan = plan_tools(ChatCompletionRequest(messages=CHAT, tools=TOOLS), auto)
    assert plan is not None and plan.choice == "auto" and plan.schema is None
    assert plan_tools(ChatCompletionRequest(messages=CHAT, tool_choice="none"), auto) is None
    named = plan_tools(ChatCompletionRequest(messages=CHAT, tools=TOOLS, tool_choice=NAMED), ServerConfig())
    assert named is not None and named.schema == WEATHER["function"]["parameters"]
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)


# ---- the schema of tool_choice "required", and the template --------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]}, "unit": {"$ref": "#/$defs/unit"},
        "tomorrow": {"type": "boolean"}},
        "required": ["city", "unit", "tomorrow"], "additionalProperties": False,
        "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
        "required": ["hour", "loud"], "additionalProperties": False}}}
TOOLS = [WEATHER, ALARM]


def test_required_schema_is_vllms_and_validates_calls() -> None:
    functions = [t["function"] for t in TOOLS]
    schema = required_schema(functions, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"unit": {"enum": ["celsius", "fahrenheit"]}}
    assert "$defs" in WEATHER["function"]["parameters"]  # (the request's tools are not changed)
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["set_alarm"]}]
    good = [{"name": "get_weather", "parameters": {"city": "Lima", "unit": "celsius", "tomorrow": True}},
            {"name": "set_alarm", "parameters": {"hour": 7, "loud": False}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"hour": 7, "loud": False}}],
                [{"name": "nope", "parameters": {}}], [{"name": "set_alarm", "parameters": {"hour": 24, "loud": True}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema(functions, parallel=False)["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_schema(functions, parallel=False))
    clash = {"name": "f", "parameters": {"$defs": {"unit": {"type": "string"}}}}
    with pytest.raises(APIError, match="defs/unit"):
        required_schema([*functions, clash], parallel=True)


def test_template_renders_tools_and_tool_history() -> None:
    tokenizer = Tokenizer.load(resolve_model_source(None).path)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "tomorrow": false}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    text = tokenizer.apply_chat_template(history, True, HERMES_TEMPLATE, TOOLS)
    assert json.dumps(WEATHER["function"]) in text  # the tools, as the template shows them
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", '
            '"tomorrow": false}}\n</tool_call>') in text  # (the arguments parsed, then shown as JSON)
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in tokenizer.apply_chat_template(history[:1], True, HERMES_TEMPLATE)
    bad = [{**history[1], "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"):
        tokenizer.apply_chat_template(bad, True, HERMES_TEMPLATE)
    # The default model's template reads neither tools nor tool_calls: the server refuses them.
    source = tokenizer.chat_template_source()
    assert source is not None and not template_uses(source, "tools")
    assert template_uses(HERMES_TEMPLATE, "tools") and template_uses(HERMES_TEMPLATE, "tool_calls")
    assert not template_uses("{# tools #}{{ messages }}", "tools")


# ---- the server, on a tiny random model ------------------------------------------------------


@dataclass
class Served:
    llm: LLM
    engine: AsyncEngine
    tools: ServerThread  # --chat-template hermes --enable-auto-tool-choice --tool-call-parser hermes
    plain: ServerThread  # the model's template, no auto tool choice

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.tools.url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("tiny-tools")
    tokenizer = Tokenizer.load(resolve_model_source(None).path)
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer.hf)})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.hf.save_pretrained(directory)
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory_bytes=64 << 20)
    engine = AsyncEngine(llm.engine)
    tools = ServerThread(build_app(engine, ServerConfig(
        chat_template=HERMES_TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes"))).start()
    plain = ServerThread(build_app(engine, ServerConfig())).start()
    try:
        yield Served(llm, engine, tools, plain)
    finally:
        tools.stop()
        plain.stop()
        engine.shutdown()


def structured_outputs_supported(llm: LLM) -> bool:
    """Whether this engine honours SamplingParams.structured_outputs (it refuses it until then)."""
    params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    try:
        llm.generate("hi", params, use_tqdm=False)
    except ValueError as e:
        if "not supported" in str(e):
            return False
        raise
    return True


CHAT = [{"role": "user", "content": "What is the weather in Paris tomorrow, in celsius?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"max_tokens": 8, **body}, timeout=TIMEOUT_S)


def assert_400(response: httpx.Response, param: str | set[str], *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] in ({param} if isinstance(param, str) else param), error
    for word in words:
        assert word in error["message"], error


def test_bad_tool_requests_are_400(served: Served) -> None:
    url, plain = served.tools.url, served.plain.url
    assert_400(post(url, {"messages": CHAT, "tools": [{"type": "function"}]}), "tools", "tools[0]")
    assert_400(post(url, {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f",
               "parameters": [1]}}]}), "tools", "parameters")
    assert_400(post(url, {"messages": CHAT, "tools": [WEATHER, WEATHER]}), "tools", "get_weather")
    assert_400(post(url, {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function",
               "function": {"name": "nope"}}}), "tool_choice", "nope")
    assert_400(post(url, {"messages": CHAT, "tool_choice": "required"}), "tool_choice", "needs tools")
    assert_400(post(url, {"messages": CHAT, "tools": TOOLS, "tool_choice": "sometimes"}), "tool_choice")
    # "auto" (the default with tools) needs the server's flags, as vLLM.
    assert_400(post(plain, {"messages": CHAT, "tools": TOOLS}), "tool_choice", "--enable-auto-tool-choice")
    # The model's template cannot show tools, nor earlier calls: the error names --chat-template.
    assert_400(post(plain, {"messages": CHAT, "tools": TOOLS, "tool_choice": "required"}), "tools",
               "--chat-template")
    history = [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    assert_400(post(plain, {"messages": history}), "messages", "--chat-template")
    # One constraint at a time (before structured outputs land, response_format itself is refused).
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert_400(post(url, {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "response_format": fmt}),
               {"tool_choice", "response_format"})
    completions = httpx.post(url + "/v1/completions", json={"prompt": "hi", "tools": TOOLS}, timeout=TIMEOUT_S)
    assert_400(completions, "tools")


def test_tool_choice_none_and_tool_history_are_served(served: Served) -> None:
    # "none": the tools go to the template where it can show them, and no calls are read back.
    for url in (served.tools.url, served.plain.url):
        response = post(url, {"messages": CHAT, "tools": TOOLS, "tool_choice": "none"})
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert message["tool_calls"] == [] and isinstance(message["content"], str)
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    assert post(served.tools.url, {"messages": history, "tools": TOOLS}).status_code == 200


def stream_message(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[str, Any], str | None]:
    """A streamed answer reassembled from its deltas (as clients merge them)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id is not None:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"] = delta.id
                if delta.function is not None and delta.function.name is not None:
                    assert call["name"] is None and call["arguments"] == "", "the name comes first, once"
                    call["name"] = delta.function.name
                if delta.function is not None and delta.function.arguments:
                    assert call["name"] is not None
                    call["arguments"] += delta.function.arguments
            reason = choice.finish_reason or reason
    return {"content": content or None, "tool_calls": [
        {"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(calls.items())]}, reason


def whole_message(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[str, Any], str | None]:
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = choice.message.tool_calls or []
    assert all(c.type == "function" and c.id for c in calls)
    return {"content": choice.message.content or None, "tool_calls": [
        {"name": c.function.name, "arguments": c.function.arguments} for c in calls]}, choice.finish_reason


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED], ids=["auto", "required", "named"])
def test_streamed_deltas_reassemble_to_the_whole_answer(served: Served, tool_choice: Any) -> None:
    if tool_choice != "auto" and not structured_outputs_supported(served.llm):
        pytest.skip("the engine does not honour structured_outputs yet")
    kwargs: dict[str, Any] = {"messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 40, "temperature": 0}
    client = served.client()
    kwargs["model"] = client.models.list().data[0].id
    whole, whole_reason = whole_message(client, **kwargs)
    streamed, stream_reason = stream_message(client, **kwargs)
    assert streamed == whole and stream_reason == whole_reason
    if tool_choice == NAMED:  # (the whole text is the call's arguments)
        assert whole["content"] is None and [c["name"] for c in whole["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_give_valid_calls(served: Served, tool_choice: Any, stream: bool) -> None:
    """A random model writes garbage unless the constraint holds: every call
    parses and validates against its function's parameters."""
    if not structured_outputs_supported(served.llm):
        pytest.skip("the engine does not honour structured_outputs yet")
    client = served.client()
    model = client.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        kwargs = {"model": model, "messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice,
                  "max_tokens": 200, "temperature": 1.0, "seed": seed, "parallel_tool_calls": seed % 2 == 0}
        message, reason = (stream_message if stream else whole_message)(client, **kwargs)
        calls = message["tool_calls"]
        assert calls and message["content"] is None, message
        assert reason == ("stop" if tool_choice == NAMED else "tool_calls")
        if tool_choice == NAMED or seed % 2:
            assert len(calls) == 1
        for call in calls:
            assert call["name"] in (["get_weather"] if tool_choice == NAMED else schemas)
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_serve_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--chat-template takes a file or the template itself; the tool flags are
    checked before the model loads."""
    from tokenmill.cli import load_chat_template, main

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}") is not None
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "nope"]) == 2
    assert "hermes, llama3_json" in capsys.readouterr().err
