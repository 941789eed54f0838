"""Tool calling: the output parsers (streamed and whole alike), the request's
tools and tool_choice, the chat template with tools, and the server end to end
on a tiny random model (tokenizer and chat template of the default model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

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
