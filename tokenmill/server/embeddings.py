"""POST /v1/embeddings, in OpenAI's shape (vLLM's fields beside it).

Each input runs as one pooling request through the same engine and scheduler
as generation (a prefill, no sampling: engine/llm_engine.py); the answer waits
for all of them. `encoding_format="base64"` sends each vector as the base64 of
its little-endian float32 bytes, which is what the openai SDK asks for by
default and decodes."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncGenerator
from typing import Literal

from fastapi import Request, Response
from pydantic import StrictBool, StrictInt, field_validator

from tokenmill.outputs import PoolingRequestOutput
from tokenmill.sampling_params import ParamError, PoolingParams
from tokenmill.server.accumulator import json_answer
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import LenientRequest, now_s, random_id
from tokenmill.server.serving import Prompt, Serving, engine_error_to_api


class EmbeddingRequest(LenientRequest):
    """OpenAI's embeddings request; `normalize`, `add_special_tokens` and
    `priority` are vLLM's additions."""

    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    normalize: StrictBool | None = None
    add_special_tokens: StrictBool = True
    priority: StrictInt = 0

    @field_validator("input", mode="before")
    @classmethod
    def _no_booleans(cls, value: object) -> object:
        items = value if isinstance(value, list) else [value]
        if any(isinstance(x, bool) or (isinstance(x, list) and any(isinstance(y, bool) for y in x))
               for x in items):
            raise ValueError("input is a string, a list of strings, token ids (integers) or a "
                             "list of lists of token ids; booleans are not token ids")
        return value


async def parse_inputs(serving: Serving, request: EmbeddingRequest) -> list[Prompt]:
    """One prompt per input, each within the context (a 400 naming `input` otherwise)."""
    raw = request.input
    items: list[str | list[int]] = []
    if isinstance(raw, str):
        items.append(raw)
    elif raw and isinstance(raw[0], int):  # one list of token ids
        items.append([t for t in raw if isinstance(t, int)])
    else:  # strings, or lists of token ids (the request model allows no mix)
        items.extend(x for x in raw if not isinstance(x, int))
    if not items:
        raise APIError(400, "input is empty; give a string, token ids or a non-empty list of them",
                       param="input")
    vocab = serving.engine.facts.vocab_size
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = await serving.encode(item, "input", request.add_special_tokens)
            prompts.append(Prompt(item, ids))
        else:
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"input token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab})", param="input")
            prompts.append(Prompt(None, list(item)))
    max_len = serving.engine.facts.max_model_len
    for i, prompt in enumerate(prompts):
        if not prompt.token_ids:
            raise APIError(400, f"input {i} is empty; give at least one token", param="input")
        if len(prompt.token_ids) > max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, input {i} has {len(prompt.token_ids)} tokens; shorten it.",
                           param="input")
    return prompts


def encode_vector(vector: list[float], encoding_format: str) -> str:
    """A vector as JSON text: a list of floats, or the base64 of float32 bytes."""
    if encoding_format == "base64":
        return json.dumps(base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode())
    return json.dumps(vector)


async def create_embedding(serving: Serving, request: EmbeddingRequest, raw: Request) -> Response:
    serving.check_model(request.model)
    if serving.engine.facts.pooler.classifier_token_ids is not None:
        # vLLM serves /v1/embeddings only for an embedding model; a reranker's one
        # value per prompt is a score, not a vector.
        raise APIError(400, "this model is loaded as a yes/no reranker (hf_overrides' "
                       "classifier_from_token): it serves /score and /rerank, not /v1/embeddings",
                       param="model")
    if serving.engine.facts.pooler.num_labels:
        raise APIError(400, "this model is a cross-encoder (a *ForSequenceClassification): it scores "
                       "text pairs at /score and /rerank, not /v1/embeddings; use an embedding "
                       "model for vectors", param="model")
    try:
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
    except ParamError as e:
        raise APIError(400, str(e), param=e.param) from e
    prompts = await parse_inputs(serving, request)
    request_id = random_id("embd")
    streams = await serving.start_pooling(request_id, prompts, params, request.priority)
    return await json_answer(raw, _answer(serving, request, request_id, prompts, streams))


async def _answer(serving: Serving, request: EmbeddingRequest, request_id: str,
                  prompts: list[Prompt],
                  streams: list[AsyncGenerator[PoolingRequestOutput, None]]) -> str:
    """The response's JSON text once every input is pooled."""
    vectors = await pooled_vectors(serving, request_id, streams)
    num_tokens = sum(len(p.token_ids) for p in prompts)
    data = ",".join(
        f'{{"index":{i},"object":"embedding","embedding":'
        f'{encode_vector(vector, request.encoding_format)}}}'
        for i, vector in enumerate(vectors))
    return (f'{{"id":{json.dumps(request_id)},"object":"list","created":{now_s()},'
            f'"model":{json.dumps(serving.model_name, ensure_ascii=True)},"data":[{data}],'
            f'"usage":{{"prompt_tokens":{num_tokens},"total_tokens":{num_tokens},'
            f'"completion_tokens":0}}}}')


async def pooled_vectors(serving: Serving, request_id: str,
                         streams: list[AsyncGenerator[PoolingRequestOutput, None]]) -> list[list[float]]:
    """Each stream's vector (Serving.start_pooling's streams of `request_id`), in
    order; the streams closed, and what still runs aborted, however it ends."""
    async def first(stream: AsyncGenerator[PoolingRequestOutput, None]) -> list[float]:
        async for out in stream:
            return out.outputs.data
        raise RuntimeError("a pooling request ended without its output")

    tasks = [asyncio.ensure_future(first(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except RuntimeError as e:  # the engine's faults and aborts (EngineError, EngineDeadError)
        raise engine_error_to_api(e) from e
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for i, stream in enumerate(streams):
            await stream.aclose()
            if not tasks[i].done() or tasks[i].cancelled():  # (never iterated: abort by id)
                serving.engine.abort(f"{request_id}-{i}")
