"""Request fields that constrain the output -> StructuredOutputsParams.

Three ways to ask, as vLLM's server takes them (one per request):
- OpenAI's `response_format`: `text` (nothing), `json_object`, `json_schema`
  (`{"name", "schema", "strict"}`);
- vLLM's extra body field `structured_outputs` (the fields of StructuredOutputsParams);
- vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
A malformed one is a 400 naming its field; a constraint that cannot be compiled
is refused by the engine (also a 400).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import SamplingFields

# StructuredOutputsParams' fields, as the `structured_outputs` body field may set them.
# (reasoning_end_token_id is the server's to set, from --reasoning-parser.)
_FIELDS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams)) - {
    "reasoning_end_token_id"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs_from_request(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None when it asks for none."""
    asked: dict[str, dict[str, Any]] = {}  # the field that asked -> StructuredOutputsParams kwargs
    if request.response_format is not None:
        kwargs = _from_response_format(request.response_format)
        if kwargs is not None:
            asked["response_format"] = kwargs
    if request.structured_outputs is not None:
        asked["structured_outputs"] = _from_structured_outputs(request.structured_outputs)
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            asked[name] = {kind: value}
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"set only one of {', '.join(sorted(asked))} (each constrains the "
                       "output)", param=sorted(asked)[-1])
    (name, kwargs), = asked.items()
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from e


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any] | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs "
                           "{'json_schema': {'name': ..., 'schema': {...}}}", param="response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", param="response_format")


def _from_structured_outputs(body: dict[str, Any]) -> dict[str, Any]:
    # Options of vLLM's that this engine does not have are refused when they ask for
    # something (the backend choice is ours: xgrammar).
    unknown = sorted(k for k, v in body.items()
                     if k not in _FIELDS and k != "backend" and v not in (None, False, ""))
    if unknown:
        raise APIError(400, f"structured_outputs.{unknown[0]} is not supported by this engine "
                       f"(it takes {', '.join(sorted(_FIELDS))})", param="structured_outputs")
    for name in ("json_object", "disable_any_whitespace"):
        if name in body and not isinstance(body[name], bool | None):
            raise APIError(400, f"structured_outputs.{name} must be a boolean, got {body[name]!r}",
                           param="structured_outputs")
    return {k: v for k, v in body.items() if k in _FIELDS}
