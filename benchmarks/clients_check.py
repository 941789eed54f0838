"""Structured outputs and tool calls through third-party clients, against a
running tokenmill server: the `openai` client, LangChain and LiteLLM, as a new
user would call them. Prints one line per check and exits 1 if any failed.

Start the server (the default model; its own template cannot show tools):

    tokenmill serve --chat-template examples/tool_chat_template_hermes.jinja \\
        --enable-auto-tool-choice --tool-call-parser hermes

then, in a venv with the clients (they need no torch):

    python3 -m venv /work/venv-lc && /work/venv-lc/bin/pip install openai langchain-openai litellm
    /work/venv-lc/bin/python benchmarks/clients_check.py [--base-url http://127.0.0.1:8000/v1]

The constrained checks (parse, json_schema, json_object, named and required
tool calls, with_structured_output, LiteLLM) need the engine's structured
outputs; "auto" needs only the parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Annotated, Any, Literal

import openai
from pydantic import BaseModel, Field

# LiteLLM fetches a price list from the internet at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class City(BaseModel):
    # (bounded: a 135M model, held to the schema, can otherwise write one string
    # or list past any max_tokens)
    name: Annotated[str, Field(max_length=24)]
    country: Annotated[str, Field(max_length=24)]
    population_millions: float
    landmarks: Annotated[list[Annotated[str, Field(max_length=32)]], Field(max_length=3)]


class Weather(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": Weather.model_json_schema()}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
# Worked examples first (assistant turns that carry tool_calls, shown by the
# template): a 135M model then answers the next question with a call of its own.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Tokyo", "unit": "celsius"}'}}]},
    {"role": "user", "content": "What is the weather in Lima?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_2", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Lima", "unit": "celsius"}'}}]},
    *ASK,
]
MAX_TOKENS = 300


def reassemble(stream: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A streamed chat answer's content, calls (name, arguments) and finish_reason."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                if d.function is not None:
                    call[0] += d.function.name or ""
                    call[1] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content or None, [tuple(c) for _, c in sorted(calls.items())], reason  # type: ignore[misc]


def whole(response: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    choice = response.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content or None, calls, choice.finish_reason


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    greedy: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS}
    results: list[bool] = []

    def check(name: str, fn: Callable[[], str]) -> None:
        try:
            detail = fn()
        except Exception as e:  # a failed check: report it, go on with the others
            results.append(False)
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
            if not isinstance(e, (AssertionError, openai.APIError)):
                traceback.print_exc(limit=2)
            return
        results.append(True)
        print(f"PASS {name}: {detail[:200]}")

    # ---- the openai client: structured outputs ------------------------------------------
    def parse() -> str:
        completion = client.chat.completions.parse(
            messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City, **greedy)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, City), completion.choices[0].message
        return repr(parsed)

    def json_schema() -> str:
        response = client.chat.completions.create(
            messages=ASK, **greedy, response_format={"type": "json_schema", "json_schema": {
                "name": "weather", "schema": Weather.model_json_schema(), "strict": True}})
        return repr(Weather.model_validate_json(response.choices[0].message.content or ""))

    def json_object() -> str:
        response = client.chat.completions.create(
            messages=[{"role": "user", "content": "Answer in JSON: what is the capital of France? Use the "
                       "keys city and country."}], **greedy,
            response_format={"type": "json_object"})
        value = json.loads(response.choices[0].message.content or "")
        assert isinstance(value, dict), value
        return json.dumps(value)

    check("openai chat.completions.parse(response_format=pydantic model)", parse)
    check("openai response_format json_schema", json_schema)
    check("openai response_format json_object", json_object)

    # ---- the openai client: tool calls -----------------------------------------------------
    def tool_call(tool_choice: Any, messages: list[dict[str, Any]], want_reason: str) -> Callable[[], str]:
        def run() -> str:
            kwargs = {"messages": messages, "tools": TOOLS, "tool_choice": tool_choice, **greedy}
            content, calls, reason = whole(client.chat.completions.create(**kwargs))
            assert calls, f"no tool call; content: {content!r}"
            for name, arguments in calls:
                assert name in ("get_weather", "get_time"), name
                if name == "get_weather":
                    Weather.model_validate_json(arguments)
                else:
                    assert isinstance(json.loads(arguments).get("city"), str), arguments
            assert reason == want_reason, reason
            streamed = reassemble(client.chat.completions.create(stream=True, **kwargs))
            assert streamed == (content, calls, reason), f"streamed {streamed} != {(content, calls, reason)}"
            return f"{calls} (streamed deltas reassemble to the same)"
        return run

    named = {"type": "function", "function": {"name": "get_weather"}}
    check("openai tool_choice named", tool_call(named, ASK, "stop"))
    check("openai tool_choice required", tool_call("required", ASK, "tool_calls"))
    check("openai tool_choice auto (hermes parser)", tool_call("auto", FEW_SHOT, "tool_calls"))

    # ---- LangChain -------------------------------------------------------------------------
    def langchain_llm() -> Any:
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=model, base_url=args.base_url, api_key="unused",  # type: ignore[arg-type]
                          temperature=0, max_tokens=MAX_TOKENS, max_retries=0)

    def lc_structured() -> str:
        out = langchain_llm().with_structured_output(City).invoke("Describe Paris as JSON.")
        assert isinstance(out, City), out
        return repr(out)

    def lc_structured_tools() -> str:
        out = langchain_llm().with_structured_output(Weather, method="function_calling").invoke(
            "What is the weather in Paris, in celsius?")
        assert isinstance(out, Weather), out
        return repr(out)

    def lc_bind_tools() -> str:
        message = langchain_llm().bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke(
            "What is the weather in Paris, in celsius?")
        calls = message.tool_calls  # type: ignore[attr-defined]
        assert calls and calls[0]["name"] == "get_weather", message
        Weather.model_validate(calls[0]["args"])
        return repr(calls)

    check("langchain with_structured_output(pydantic model)", lc_structured)
    check("langchain with_structured_output(method='function_calling')", lc_structured_tools)
    check("langchain bind_tools(tool_choice=name)", lc_bind_tools)

    # ---- LiteLLM ---------------------------------------------------------------------------
    def litellm_format() -> str:
        import litellm

        response = litellm.completion(
            model=f"openai/{model}", api_base=args.base_url, api_key="unused", temperature=0,
            max_tokens=MAX_TOKENS, messages=ASK, response_format=Weather)
        return repr(Weather.model_validate_json(response.choices[0].message.content))

    check("litellm completion(response_format=pydantic model)", litellm_format)

    print(f"{sum(results)}/{len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
