"""Tool calls out of generated text, as it streams (vLLM's --tool-call-parser).

A parser takes the text deltas of one choice and returns events: content text,
the start of a call (its name), and fragments of the call's arguments (JSON
text). The chat endpoint turns them into OpenAI's stream chunks (`tool_calls`
deltas: index, id, type and the function's name first, then the arguments in
pieces) and, for a whole answer, feeds the text as one delta: the streamed
and the whole answer are the same code, so they are the same calls.

Text that may be the start of a call is held back until it is known; a call
whose JSON turns out not to be a call (no name, not an object) comes back as
content, as it was written.

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, text around it is content
    llama3_json   {"name": ..., "parameters": {...}} (optionally after <|python_tag|>), calls joined by ";"
    (named)       tool_choice names a function: the whole text is its arguments
    (required)    tool_choice "required": a JSON array of {"name": ..., "parameters": {...}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

# ---- events -------------------------------------------------------------------------------


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""


@dataclass
class ParsedMessage:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def collect(events: list[Event], into: ParsedMessage | None = None) -> ParsedMessage:
    """Events folded into a message (content and calls, arguments joined)."""
    message = into if into is not None else ParsedMessage()
    for event in events:
        if isinstance(event, Content):
            message.content += event.text
        elif isinstance(event, CallStart):
            message.calls.append(ParsedCall(event.name))
        else:
            message.calls[event.index].arguments += event.text
    return message


# ---- one JSON object, followed as it arrives ------------------------------------------------

_WHITESPACE = " \t\n\r"


class _ObjectScanner:
    """Follows the text of one JSON object character by character and records,
    for each top-level key, where its value's text starts and (once complete)
    ends. It finds value boundaries only (strings, escapes, nesting); whether
    the values are valid JSON is json.loads' business once they are whole."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # the next character to scan
        self.state = "start"  # start, key, colon, value, after, done, error
        self.depth = 0  # open containers; the object itself is 1
        self.in_string = False
        self.escaped = False
        self.token_start = 0  # where the current key or top-level value began
        self.key = ""
        self.values: dict[str, tuple[int, int | None]] = {}

    def feed(self, text: str) -> None:
        self.text += text
        while self.pos < len(self.text) and self.state not in ("done", "error"):
            self._step(self.text[self.pos])
            if self.state != "error":  # (the character that broke it is not consumed)
                self.pos += 1

    @property
    def consumed(self) -> str:
        return self.text[: self.pos]

    def value_text(self, key: str) -> tuple[str, bool] | None:
        """The text of `key`'s value seen so far, and whether it is complete."""
        span = self.values.get(key)
        if span is None:
            return None
        start, end = span
        return (self.text[start:end], True) if end is not None else (self.text[start : self.pos], False)

    def string_value(self, key: str) -> str | None:
        """`key`'s value when it is a complete JSON string (else None)."""
        found = self.value_text(key)
        if found is None or not found[1] or not found[0].startswith('"'):
            return None
        try:
            value = json.loads(found[0])
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, str) else None

    def _step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.state == "key":
                    try:
                        self.key = str(json.loads(self.text[self.token_start : self.pos + 1]))
                    except json.JSONDecodeError:
                        self.state = "error"
                        return
                    self.state = "colon"
                elif self.depth == 1 and self.state == "value":  # a top-level string value ends
                    self._end_value(self.pos + 1)
            return
        if self.state == "start":
            if ch == "{":
                self.depth, self.state = 1, "key"
            elif ch not in _WHITESPACE:
                self.state = "error"
        elif self.state == "key":
            if ch == '"':
                self.in_string, self.token_start = True, self.pos
            elif ch == "}" and not self.values:
                self.depth, self.state = 0, "done"
            elif ch not in _WHITESPACE:
                self.state = "error"
        elif self.state == "colon":
            if ch == ":":
                self.state, self.token_start = "value", -1
            elif ch not in _WHITESPACE:
                self.state = "error"
        elif self.state == "value":
            self._step_value(ch)
        elif self.state == "after":
            if ch == ",":
                self.state = "key"
            elif ch == "}":
                self.depth, self.state = 0, "done"
            elif ch not in _WHITESPACE:
                self.state = "error"

    def _step_value(self, ch: str) -> None:
        if self.token_start < 0:  # before the value
            if ch in _WHITESPACE:
                return
            self.token_start = self.pos
            self.values[self.key] = (self.pos, None)
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in ",}]:":
                self.state = "error"
            return
        if self.depth == 1:  # a number, true, false or null: ends at a delimiter
            if ch in _WHITESPACE or ch in ",}":
                self._end_value(self.pos)
                self._step(ch)  # the delimiter belongs to the object
            return
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._end_value(self.pos + 1)

    def _end_value(self, end: int) -> None:
        self.values[self.key] = (self.values[self.key][0], end)
        self.state = "after"


class _CallObject:
    """One call written as a JSON object, {"name": ..., ARGS: {...}}: emits the
    call's start once its name is whole, then its arguments as they arrive (an
    object's text streams; any other value is sent whole once complete)."""

    def __init__(self, index: int, argument_keys: tuple[str, ...]) -> None:
        self.index = index
        self.argument_keys = argument_keys
        self.scanner = _ObjectScanner()
        self.started = False  # the name was emitted
        self.sent = 0  # characters of the arguments' text emitted

    @property
    def done(self) -> bool:
        return self.scanner.state == "done"

    @property
    def failed(self) -> bool:
        return self.scanner.state == "error"

    def feed(self, text: str) -> tuple[list[Event], str, str]:
        """Events, the text this object consumed, and the text past its end
        (or from the character that showed it is no JSON object)."""
        before = self.scanner.pos
        self.scanner.feed(text)
        rest = self.scanner.text[self.scanner.pos :]
        self.scanner.text = self.scanner.text[: self.scanner.pos]
        return self._events(final=self.done), self.scanner.text[before:], rest

    def finish(self) -> list[Event]:
        """At the end of the text: whatever of the arguments is still held."""
        return self._events(final=True)

    def _events(self, final: bool) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            name = self.scanner.string_value("name")
            if name is None:
                return events
            self.started = True
            events.append(CallStart(self.index, name))
        key = next((k for k in self.argument_keys if k in self.scanner.values), None)
        if key is None:
            if final and self.sent == 0:  # no arguments: an empty object
                self.sent = 2
                events.append(CallArguments(self.index, "{}"))
            return events
        text, complete = self.scanner.value_text(key) or ("", False)
        if text.startswith("{"):
            if len(text) > self.sent:
                events.append(CallArguments(self.index, text[self.sent :]))
                self.sent = len(text)
        elif (complete or final) and self.sent == 0 and text:
            self.sent = len(text)
            try:  # arguments written as a JSON string holding the object
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            events.append(CallArguments(self.index, value if isinstance(value, str) else text))
        return events


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- the parsers ------------------------------------------------------------------------------


class ToolParser:
    """One choice's text -> events: feed() each delta, finish() at the end."""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedMessage:
        """A whole answer (the same code as streaming)."""
        return collect(self.feed(text) + self.finish())


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (NousResearch
    Hermes, Qwen); text outside the tags is content."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""  # text not yet turned into events
        self.call: _CallObject | None = None  # inside a <tool_call>
        self.call_text = ""  # the raw text of the open call (content again if it is no call)
        self.after_call = False  # the call's object ended: skip to the closing tag
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer:
            if self.call is None:  # content, up to a <tool_call>
                at = self.buffer.find(self.START)
                if at < 0:
                    cut = len(self.buffer) - _held_prefix(self.buffer, self.START)
                    if cut:
                        events.append(Content(self.buffer[:cut]))
                    self.buffer = self.buffer[cut:]
                    break
                if at:
                    events.append(Content(self.buffer[:at]))
                self.buffer = self.buffer[at + len(self.START) :]
                self.call = _CallObject(self.num_calls, ("arguments", "parameters"))
                self.call_text, self.after_call = self.START, False
            elif self.after_call:  # past the object: whitespace, then </tool_call>
                stripped = self.buffer.lstrip()
                if self.END.startswith(stripped):  # (all of it, or a part so far)
                    if stripped == self.END:
                        self.buffer, self.call = "", None
                    break
                if stripped.startswith(self.END):
                    self.buffer, self.call = stripped[len(self.END) :], None
                else:  # no closing tag: what follows is content again
                    self.call = None
            elif not self._feed_call(events):
                break
        return events

    def _feed_call(self, events: list[Event]) -> bool:
        """Feeds the open call what the buffer holds of it; False: wait for more."""
        assert self.call is not None
        call = self.call
        end = self.buffer.find(self.END)
        # (a text that may be the start of </tool_call> waits: the object must
        # not swallow it, whatever the chunking)
        size = end if end >= 0 else len(self.buffer) - _held_prefix(self.buffer, self.END)
        new, used, rest = call.feed(self.buffer[:size])
        self.call_text += used
        self.buffer = rest + self.buffer[size:]
        if call.failed and not call.started:  # not a call: as written, content
            events.append(Content(self.call_text))
            self.call = None
            return True
        events += new
        if call.done or call.failed:
            if call.failed:
                events += call.finish()
            if not call.started:  # an object without a name: not a call
                events.append(Content(self.call_text))
                self.call = None
                return True
            self.num_calls += 1
            self.after_call = True
            return True
        if end >= 0:  # </tool_call> before the object ended
            self.buffer = self.buffer[len(self.END) :]
            if call.started:
                events += call.finish()
                self.num_calls += 1
            else:
                events.append(Content(self.call_text + self.END))
            self.call = None
            return True
        return False

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.call is not None and not self.after_call:
            new, used, rest = self.call.feed(self.buffer)
            events += new
            if self.call.started:
                events += self.call.finish()
                self.num_calls += 1
            else:
                events.append(Content(self.call_text + used + rest))
        elif self.call is None and self.buffer:
            events.append(Content(self.buffer))
        self.buffer, self.call = "", None
        return events


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: the answer is {"name": ..., "parameters": {...}}
    (or "arguments"), optionally after <|python_tag|>, several joined by ";".
    An answer that does not begin with a call is content, as it is."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.buffer = ""
        self.mode = "start"  # start, content, between, call
        self.skipped = ""  # the text before the first call (content, if it is no call)
        self.call: _CallObject | None = None
        self.call_text = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer:
            if self.mode == "start":  # is the answer a call?
                head = self.buffer.lstrip()
                if head.startswith(self.PYTHON_TAG):
                    head = head[len(self.PYTHON_TAG) :].lstrip()
                    if not head:
                        break
                elif not head or self.PYTHON_TAG.startswith(head):
                    break  # (whitespace or a part of the tag so far)
                if head.startswith("{"):
                    self.skipped = self.buffer[: len(self.buffer) - len(head)]
                    self.mode, self.buffer = "between", head
                else:
                    self.mode = "content"
            elif self.mode == "content":
                events.append(Content(self.buffer))
                self.buffer = ""
            elif self.mode == "between":  # before a call: whitespace and ";"
                head = self.buffer.lstrip(_WHITESPACE + ";")
                if not head:
                    break
                if head[0] != "{":  # not a call: the rest is content
                    self.mode = "content"
                    continue
                self.buffer, self.mode = head, "call"
                self.call, self.call_text = _CallObject(self.num_calls, ("parameters", "arguments")), ""
            else:
                assert self.call is not None
                call = self.call
                new, used, self.buffer = call.feed(self.buffer)
                self.call_text += used
                events += new
                if not (call.done or call.failed):
                    break
                if call.started:
                    if call.failed:
                        events += call.finish()
                    self.num_calls += 1
                    self.mode = "between" if call.done else "content"
                else:  # not a call: it and what follows are content
                    events.append(Content(self._unsent() + self.call_text))
                    self.mode = "content"
                self.call = None
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.call is not None:
            if self.call.started:
                events += self.call.finish()
                self.num_calls += 1
            else:
                events.append(Content(self._unsent() + self.call_text))
        elif self.mode in ("start", "content") and self.buffer:
            events.append(Content(self.buffer))
        self.buffer, self.call = "", None
        return events


    def _unsent(self) -> str:
        """The text skipped before the first call, if no call came before."""
        return self.skipped if self.num_calls == 0 else ""


class NamedToolParser(ToolParser):
    """tool_choice names a function: the text is that call's arguments (the
    engine constrains it to the function's parameters' schema)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            events.append(CallStart(0, self.name))
        if text:
            events.append(CallArguments(0, text))
        return events

    def finish(self) -> list[Event]:
        return [] if self.started else self.feed("")


class RequiredToolParser(ToolParser):
    """tool_choice "required": the text is a JSON array of calls, each
    {"name": ..., "parameters": {...}} (the engine constrains it to that).
    A text that is no such array (an engine without the constraint) is content."""

    # state -> the characters that may come next (after whitespace)
    EXPECTED: ClassVar[dict[str, str]] = {"start": "[", "first": "{]", "item": "{", "next": ",]"}

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "start"  # a key of EXPECTED, or call, end, failed
        self.call: _CallObject | None = None
        self.num_calls = 0
        self.raw = ""  # all the text: content, if no call comes of it
        self.raw_sent = 0

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        self.raw += text
        events: list[Event] = []
        while self.buffer and self.state not in ("end", "failed"):
            if self.state == "call":
                assert self.call is not None
                new, _, self.buffer = self.call.feed(self.buffer)
                events += new
                if self.call.failed or (self.call.done and not self.call.started):
                    self.state = "failed"
                elif self.call.done:
                    self.num_calls += 1
                    self.call, self.state = None, "next"
                else:
                    break
                continue
            head = self.buffer.lstrip()
            if not head:
                break
            ch = head[0]
            if ch not in self.EXPECTED[self.state]:
                self.state = "failed"
            elif ch == "{":
                self.buffer, self.state = head, "call"
                self.call = _CallObject(self.num_calls, ("parameters", "arguments"))
            else:
                self.buffer = head[1:]
                self.state = {"[": "first", ",": "item", "]": "end"}[ch]
        if self.state == "failed" and not self._any_call():
            events.append(Content(self.raw[self.raw_sent :]))
            self.raw_sent = len(self.raw)
        return events

    def _any_call(self) -> bool:
        return self.num_calls > 0 or (self.call is not None and self.call.started)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.call is not None and self.call.started:
            events += self.call.finish()
            self.num_calls += 1
        elif not self._any_call() and self.raw_sent < len(self.raw):
            events.append(Content(self.raw[self.raw_sent :]))
        self.call, self.buffer, self.raw_sent = None, "", len(self.raw)
        return events


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
