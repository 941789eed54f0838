"""POST /score (vLLM's: text_1, text_2) and /rerank, /v1/rerank, /v2/rerank
(Jina's and Cohere's: query, documents, top_n, return_documents), for an
embedding model: a pair's score is the cosine similarity of the two texts'
embeddings, as vLLM scores with an embedding model. Every text runs as one
pooling request (embeddings.py); repeated texts run once. A yes/no reranker
(hf_overrides' classifier_from_token) runs each pair as one prompt instead
(engine/score_template.py) and its pooled value is the score. So does a
cross-encoder (a BERT / XLM-R *ForSequenceClassification): the pair joined by
its tokenizer (with BERT's token types), its classifier's logit through the
model's activation (sigmoid for one label, as vLLM; `use_activation`: false
gives the raw logit)."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request, Response
from pydantic import StrictBool, StrictInt

from tokenmill.engine.llm import cosine_similarity
from tokenmill.engine.score_template import score_prompt
from tokenmill.sampling_params import PoolingParams
from tokenmill.server.accumulator import json_answer
from tokenmill.server.embeddings import pooled_vectors
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import LenientRequest, now_s, random_id
from tokenmill.server.serving import Prompt, Serving


class ScoreRequest(LenientRequest):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: StrictInt = 0
    use_activation: StrictBool | None = None  # (vLLM's: a cross-encoder's activation)


class RerankRequest(LenientRequest):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: StrictInt | None = None  # None or 0: every document
    return_documents: StrictBool = True
    priority: StrictInt = 0
    use_activation: StrictBool | None = None


async def _prompt(serving: Serving, text: str, param: str) -> Prompt:
    ids = await serving.encode(text, param)
    max_len = serving.engine.facts.max_model_len
    if not ids:
        raise APIError(400, f"a text of {param} is empty; give at least one token", param=param)
    if len(ids) > max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, "
                       f"a text of {param} has {len(ids)} tokens; shorten it.", param=param)
    return Prompt(text, ids)


async def _score_pairs(serving: Serving, prefix: str, pairs: list[tuple[str, str]],
                       params: tuple[str, str], priority: int,
                       use_activation: bool | None = None) -> tuple[list[float], int]:
    """Each pair's cosine similarity (a yes/no reranker's or a cross-encoder's
    score), and the prompt tokens run (each distinct text once). `params` names
    the first and second texts' fields in errors."""
    pooler = serving.engine.facts.pooler
    if pooler.classifier_token_ids is not None:
        return await _classify_pairs(serving, prefix, pairs, params, priority, pooler.score_template)
    if pooler.num_labels:
        return await _cross_encode(serving, prefix, pairs, params, priority, use_activation)
    texts: dict[str, Prompt] = {}
    for first, second in pairs:
        for text, param in ((first, params[0]), (second, params[1])):
            if text not in texts:
                texts[text] = await _prompt(serving, text, param)
    request_id = random_id(prefix)
    streams = await serving.start_pooling(request_id, list(texts.values()), PoolingParams(), priority)
    vectors = dict(zip(texts, await pooled_vectors(serving, request_id, streams), strict=True))
    scores = [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs]
    return scores, sum(len(p.token_ids) for p in texts.values())


async def _cross_encode(serving: Serving, prefix: str, pairs: list[tuple[str, str]],
                        params: tuple[str, str], priority: int,
                        use_activation: bool | None) -> tuple[list[float], int]:
    """A cross-encoder's score of each pair, the pair run as one prompt."""
    labels = serving.engine.facts.pooler.num_labels
    if labels != 1:
        raise APIError(400, f"this cross-encoder has {labels} labels; a score is one value",
                       param="model")
    tokenizer = serving.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this engine runs without a tokenizer; a cross-encoder's text pairs "
                       "need it", param="model")
    max_len = serving.engine.facts.max_model_len
    prompts: dict[tuple[str, str], Prompt] = {}
    for pair in pairs:
        if pair in prompts:
            continue
        for text, param in zip(pair, params, strict=True):
            if not text:
                raise APIError(400, f"a text of {param} is empty; give at least one character",
                               param=param)
            serving.check_text_length(text, param)
        try:
            ids, types = await asyncio.to_thread(tokenizer.encode_pair, *pair)
        except ValueError as e:
            raise APIError(400, str(e), param=params[1]) from e
        if len(ids) > max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, "
                           f"a pair of {params[0]} and {params[1]} has {len(ids)} tokens; shorten it.",
                           param=params[1])
        prompts[pair] = Prompt(None, ids, types)
    request_id = random_id(prefix)
    streams = await serving.start_pooling(request_id, list(prompts.values()),
                                          PoolingParams(use_activation=use_activation), priority)
    values = dict(zip(prompts, await pooled_vectors(serving, request_id, streams), strict=True))
    return [values[pair][0] for pair in pairs], sum(len(p.token_ids) for p in prompts.values())


async def _classify_pairs(serving: Serving, prefix: str, pairs: list[tuple[str, str]],
                          params: tuple[str, str], priority: int,
                          template: str | None) -> tuple[list[float], int]:
    prompts: dict[str, Prompt] = {}
    for first, second in pairs:
        for text, param in ((first, params[0]), (second, params[1])):
            if not text:
                raise APIError(400, f"a text of {param} is empty; give at least one character",
                               param=param)
        text = score_prompt(first, second, template)
        if text not in prompts:
            prompts[text] = await _prompt(serving, text, params[1])
    request_id = random_id(prefix)
    streams = await serving.start_pooling(request_id, list(prompts.values()), PoolingParams(), priority)
    values = dict(zip(prompts, await pooled_vectors(serving, request_id, streams), strict=True))
    scores = [values[score_prompt(a, b, template)][0] for a, b in pairs]
    return scores, sum(len(p.token_ids) for p in prompts.values())


async def create_score(serving: Serving, request: ScoreRequest, raw: Request) -> Response:
    serving.check_model(request.model)
    firsts = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
    seconds = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
    if not firsts or not seconds:
        raise APIError(400, "text_1 and text_2 must each hold at least one text",
                       param="text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}; give one "
                       "text_1, or as many as text_2", param="text_1")

    async def answer() -> str:
        scores, num_tokens = await _score_pairs(serving, "score", list(zip(firsts, seconds, strict=True)),
                                                ("text_1", "text_2"), request.priority,
                                                request.use_activation)
        data = ",".join(f'{{"index":{i},"object":"score","score":{json.dumps(s)}}}'
                        for i, s in enumerate(scores))
        return (f'{{"id":{json.dumps(random_id("score"))},"object":"list","created":{now_s()},'
                f'"model":{json.dumps(serving.model_name)},"data":[{data}],'
                f'"usage":{{"prompt_tokens":{num_tokens},"total_tokens":{num_tokens},'
                f'"completion_tokens":0}}}}')

    return await json_answer(raw, answer())


async def create_rerank(serving: Serving, request: RerankRequest, raw: Request) -> Response:
    serving.check_model(request.model)
    if not request.documents:
        raise APIError(400, "documents is empty; give at least one document", param="documents")
    if request.top_n is not None and request.top_n < 0:
        raise APIError(400, f"top_n must be >= 0 (0: every document), got {request.top_n}",
                       param="top_n")
    pairs = [(request.query, document) for document in request.documents]

    async def answer() -> str:
        scores, num_tokens = await _score_pairs(serving, "rerank", pairs, ("query", "documents"),
                                                request.priority, request.use_activation)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            ranked = ranked[: request.top_n]
        results = []
        for i in ranked:
            document = (f',"document":{{"text":{json.dumps(request.documents[i])}}}'
                        if request.return_documents else "")
            results.append(f'{{"index":{i}{document},"relevance_score":{json.dumps(scores[i])}}}')
        return (f'{{"id":{json.dumps(random_id("rerank"))},"model":{json.dumps(serving.model_name)},'
                f'"usage":{{"prompt_tokens":{num_tokens},"total_tokens":{num_tokens}}},'
                f'"results":[{",".join(results)}]}}')

    return await json_answer(raw, answer())
