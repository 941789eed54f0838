"""Tool calling on /v1/chat/completions: the request's `tools`, `tool_choice`
and `parallel_tool_calls`, checked and turned into what the request needs:
the tools for the chat template, a JSON-schema constraint on the output
(tool_choice "required" or a named function: the engine's structured output
makes even a tiny model write valid calls, as vLLM does), and the parser that
reads the calls back out of the text (tool_parsers.py), streamed or whole.

tool_choice "auto" (the default when tools are given) lets the model choose,
and needs the server started with --enable-auto-tool-choice and
--tool-call-parser NAME (vLLM's flags); "none" shows the tools to the template
(as vLLM does by default) and reads no calls back.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.config import ServerConfig
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from tokenmill.server.tool_parsers import (
    TOOL_PARSERS,
    CallArguments,
    CallStart,
    Content,
    Event,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def check_tool_call_parser(config: ServerConfig) -> None:
    """ValueError for a --tool-call-parser this server does not have."""
    name = config.tool_call_parser
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}")


@dataclass
class ToolPlan:
    """What one request's tools ask for."""

    tools: list[dict[str, Any]]  # as the chat template takes them (OpenAI's shape)
    choice: str  # none, auto, required, named
    name: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # the constraint (required, named)
    parser: str | None = None  # the --tool-call-parser (auto)
    parallel: bool = True

    def new_parser(self) -> ToolParser | None:
        if self.choice == "named":
            assert self.name is not None
            return NamedToolParser(self.name)
        if self.choice == "required":
            return RequiredToolParser()
        if self.choice == "auto" and self.parser is not None:
            return TOOL_PARSERS[self.parser]()
        return None


def _function(tool: Any, i: int) -> dict[str, Any]:
    """tools[i]'s function, checked: {"name": str, "description"?: str, "parameters"?: {...}}."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise APIError(400, f"tools[{i}].function must be an object with a non-empty string 'name'",
                       param="tools")
    if not isinstance(function.get("parameters", {}), Mapping | None):
        raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    if not isinstance(function.get("description", ""), str | None):
        raise APIError(400, f"tools[{i}].function.description must be a string", param="tools")
    return dict(function)


def plan_tools(request: ChatCompletionRequest, config: ServerConfig) -> ToolPlan | None:
    """The request's tools checked against each other and the server (400s
    name the field, with vLLM's rules); None when the request has none."""
    tools = request.tools or []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: two functions are named {_first_duplicate(names)!r}", param="tools")
    choice: Any = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = request.parallel_tool_calls is not False
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan(tools, "none") if tools else None
    if not tools:
        raise APIError(400, f"tool_choice {_show(choice)} needs tools; none were given", param="tool_choice")
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set (start the server with them, or send "
                           'tool_choice "required", a named function, or "none")', param="tool_choice")
        return ToolPlan(tools, "auto", parser=config.tool_call_parser, parallel=parallel)
    if choice == "required":
        return ToolPlan(tools, "required", schema=required_schema(functions, parallel), parallel=parallel)
    if (isinstance(choice, Mapping) and choice.get("type", "function") == "function"
            and isinstance(choice.get("function"), Mapping)
            and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools "
                           f"({', '.join(names)})", param="tool_choice")
        parameters = functions[names.index(name)].get("parameters") or EMPTY_PARAMETERS
        return ToolPlan(tools, "named", name=name, schema=dict(parameters))
    raise APIError(400, 'tool_choice must be "none", "auto", "required" or '
                   f"{{'type': 'function', 'function': {{'name': ...}}}}, got {_show(choice)}",
                   param="tool_choice")


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The output of tool_choice "required", as vLLM builds it: an array of
    {"name": <one of the functions>, "parameters": <its parameters>} (one item
    unless parallel_tool_calls), with the tools' $defs gathered at the top."""
    defs: dict[str, Any] = {}
    choices = []
    for function in functions:
        parameters = copy.deepcopy(dict(function.get("parameters") or EMPTY_PARAMETERS))
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise APIError(400, f"tools define '$defs/{key}' twice, differently", param="tools")
            defs[key] = value
        choices.append({
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def constrain(plan: ToolPlan | None, params: SamplingParams) -> None:
    """tool_choice "required" or named: the output held to the calls' schema
    by structured output. A request that also asks for a structured
    response_format (or structured_outputs) is refused: one constraint only."""
    if plan is None or plan.schema is None:
        return
    if params.structured_outputs is not None:
        raise APIError(400, f"tool_choice {plan.choice!r} holds the output to tool calls; it cannot be "
                       "combined with a structured response_format or structured_outputs",
                       param="tool_choice")
    params.structured_outputs = StructuredOutputsParams(json=plan.schema)


_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)


def template_uses(source: str, name: str) -> bool:
    """Whether a chat template reads `name` (comments aside)."""
    return re.search(rf"\b{re.escape(name)}\b", _COMMENT.sub("", source)) is not None


def template_tools(plan: ToolPlan | None, messages: list[dict[str, Any]], source: str | None) -> (
        list[dict[str, Any]] | None):
    """The tools to render. 400 naming --chat-template when the template cannot
    show what the request needs it to: tools it may call, or earlier calls."""
    advice = ("; start the server with --chat-template PATH, a template that renders tools "
              "(e.g. examples/tool_chat_template_hermes.jinja)")
    if source is not None and any(m.get("tool_calls") for m in messages) and not template_uses(source, "tool_calls"):
        raise APIError(400, "an assistant message carries tool_calls, and this chat template cannot "
                       "show them" + advice, param="messages")
    if plan is None:
        return None
    if source is not None and not template_uses(source, "tools"):
        if plan.choice == "none":
            return None  # (they are not used: the template goes without them)
        raise APIError(400, "this model's chat template cannot show tools" + advice, param="tools")
    return plan.tools


def _show(value: Any) -> str:
    return repr(value)[:80]


def _first_duplicate(names: list[str]) -> str:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return ""


# ---- the answer -----------------------------------------------------------------------------


def finish_reason(plan: ToolPlan, called: bool, reason: str | None) -> str | None:
    """"tool_calls" where calls ended the answer ("auto" and "required"); a
    named function keeps "stop", as OpenAI and vLLM."""
    if reason == "stop" and called and plan.choice in ("auto", "required"):
        return "tool_calls"
    return reason


def whole_message(plan: ToolPlan, text: str) -> ChatResponseMessage:
    """A non-streamed answer's message: content and tool calls."""
    parser = plan.new_parser()
    if parser is None:
        return ChatResponseMessage(content=text)
    parsed = parser.parse(text)
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    return ChatResponseMessage(
        content=parsed.content or (None if calls else ""),
        tool_calls=[ToolCall(id=random_id("chatcmpl-tool"), function=FunctionCall(name=c.name, arguments=c.arguments))
                    for c in calls],
    )


class ToolStream:
    """One streamed choice: text deltas in, (content, tool-call deltas) out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.new_parser()
        self.called = False

    def feed(self, text: str, final: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        if self.parser is None:
            return text or None, None
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        return self._deltas(events)

    def _deltas(self, events: list[Event]) -> tuple[str | None, list[DeltaToolCall] | None]:
        content = "".join(e.text for e in events if isinstance(e, Content))
        deltas: list[DeltaToolCall] = []
        for e in events:
            if isinstance(e, Content) or (not self.plan.parallel and e.index > 0):
                continue
            self.called = True
            if isinstance(e, CallStart):
                deltas.append(DeltaToolCall(index=e.index, id=random_id("chatcmpl-tool"), type="function",
                                            function=DeltaFunctionCall(name=e.name, arguments="")))
            elif isinstance(e, CallArguments):
                last = deltas[-1] if deltas else None
                if last is not None and last.index == e.index and last.function is not None:
                    last.function.arguments = (last.function.arguments or "") + e.text
                else:
                    deltas.append(DeltaToolCall(index=e.index, function=DeltaFunctionCall(arguments=e.text)))
        return content or None, deltas or None

