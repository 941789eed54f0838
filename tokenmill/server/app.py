"""The FastAPI app, built by a factory around a running engine (an EngineClient)."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill import envs
from tokenmill.config import ServerConfig
from tokenmill.engine.client import EngineClient
from tokenmill.server.chat import chat_prompt, create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.dashboard import build_dashboard_router
from tokenmill.server.embeddings import EmbeddingRequest, create_embedding
from tokenmill.server.errors import (
    APIError,
    describe_validation_error,
    error_json,
    install_error_handlers,
    is_anthropic_path,
)
from tokenmill.server.limits import RequestLimits
from tokenmill.server.messages import (
    CountTokensRequest,
    MessagesRequest,
    count_tokens,
    create_message,
)
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from tokenmill.server.responses import ResponsesRequest, ResponseStore, create_response, not_found
from tokenmill.server.scores import RerankRequest, ScoreRequest, create_rerank, create_score
from tokenmill.server.serving import Serving

TOKENIZE_PATHS = ("/tokenize", "/detokenize")
# Scoring routes outside /v1 (vLLM's and Jina's / Cohere's): they run the model,
# so the key guards them as it guards /v1.
SCORE_PATHS = ("/score", "/rerank", "/v2/rerank")


class APIKeyCheck:
    """401 for a /v1 request without the key, before its body is read or
    validated (as vLLM: a caller without the key learns nothing about the API);
    also for /tokenize and /detokenize unless `open_tokenize` (vLLM leaves them
    open; here they are bounded but still cost the server work), and for the
    scoring routes outside /v1 (SCORE_PATHS)."""

    def __init__(self, app: ASGIApp, api_key: str, open_tokenize: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_tokenize = open_tokenize

    def covers(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path in SCORE_PATHS or (
            not self.open_tokenize and path in TOKENIZE_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and self.covers(path):
            headers = Headers(scope=scope)
            given = headers.get("authorization", "").encode()
            # Anthropic's clients send the key as x-api-key (its Messages API only).
            if is_anthropic_path(path) and "x-api-key" in headers:
                given = b"Bearer " + headers["x-api-key"].encode("latin-1")
            if not secrets.compare_digest(given, self.expected):
                response = error_json(
                    401, "missing or wrong API key; send 'Authorization: Bearer <key>'"
                    + (" or 'x-api-key: <key>'" if is_anthropic_path(path) else ""),
                    code="invalid_api_key", path=path,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: EngineClient, server_config: ServerConfig) -> FastAPI:
    """An OpenAI-compatible app serving `engine`. The engine is the caller's to
    start and shut down; several apps may share one (each has its own metrics
    registry). `app.state.serving.close()` stops the app's template worker."""
    model_name = server_config.served_model_name or engine.facts.model_name
    serving = Serving(engine, server_config, model_name)
    metrics = ServerMetrics(engine, model_name, server_config.metrics_prefix)
    response_store = ResponseStore(server_config.max_stored_responses)
    app = FastAPI(title="tokenmill", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    if server_config.api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=server_config.api_key,
                           open_tokenize=server_config.allow_unauthenticated_tokenize)
    # Added last, so it runs first: sizes are checked before anything else.
    app.add_middleware(RequestLimits, max_body_bytes=server_config.max_request_body_bytes)

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        serving.apply_generation_defaults(request)
        return await create_completion(serving, request, raw)

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        serving.apply_generation_defaults(request)
        return await create_chat_completion(serving, request, raw)

    @v1.post("/responses")
    async def responses(request: ResponsesRequest, raw: Request) -> Response:
        serving.apply_generation_defaults(request)
        return await create_response(serving, response_store, request, raw)

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        stored = response_store.get(response_id)
        if stored is None:
            raise not_found(response_id, None)
        return JSONResponse(stored[0])

    @v1.post("/embeddings")
    async def embeddings(request: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(serving, request, raw)

    @v1.post("/messages")
    async def messages(request: MessagesRequest, raw: Request) -> Response:
        return await create_message(serving, request, raw)

    @v1.post("/messages/count_tokens")
    async def messages_count_tokens(request: CountTokensRequest) -> JSONResponse:
        return JSONResponse(await count_tokens(serving, request))

    @v1.get("/models")
    async def models() -> ModelList:
        max_model_len = engine.facts.max_model_len
        return ModelList(data=[
            ModelCard(id=model_name, root=engine.facts.model_path, max_model_len=max_model_len),
            *(ModelCard(id=name, root=lora.lora_path, parent=model_name, max_model_len=max_model_len)
              for name, lora in serving.loras.items())])

    if envs.allow_runtime_lora_updating():  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            await serving.load_lora(request.lora_name, request.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            await serving.unload_lora(request.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    app.include_router(v1)

    # vLLM's /score and /v1/score; Jina's /v1/rerank, Cohere's /v2/rerank, vLLM's /rerank.
    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: ScoreRequest, raw: Request) -> Response:
        return await create_score(serving, request, raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: RerankRequest, raw: Request) -> Response:
        return await create_rerank(serving, request, raw)
    if server_config.dashboard:  # `serve --dashboard`: /dashboard and its event feed
        app.include_router(build_dashboard_router(engine, model_name))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        serving.check_model(request.model, adapters=True)  # (an adapter's tokenizer is its base's)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if request.messages is not None:
            try:
                chat = ChatCompletionRequest(
                    messages=request.messages, add_generation_prompt=request.add_generation_prompt,
                    chat_template_kwargs=request.chat_template_kwargs,
                )
            except ValidationError as e:  # e.g. no messages
                message, param = describe_validation_error(e.errors())
                raise APIError(400, message, param) from e
            tokens = (await chat_prompt(serving, chat)).token_ids
        else:
            tokens = await serving.encode(request.prompt or "", "prompt", request.add_special_tokens)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": engine.facts.max_model_len, "tokens": tokens}
        )

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        serving.check_model(request.model, adapters=True)
        if len(request.tokens) > engine.facts.max_model_len:  # (bounded as a prompt is)
            raise APIError(
                400, f"{len(request.tokens)} token ids are more than this model's maximum "
                f"context length of {engine.facts.max_model_len}", param="tokens",
            )
        bad = [t for t in request.tokens if not 0 <= t < engine.facts.vocab_size]
        if bad:
            raise APIError(
                400, f"token ids {bad[:5]} are outside the vocabulary [0, {engine.facts.vocab_size})",
                param="tokens",
            )
        # Special tokens kept, as vLLM's /detokenize: /tokenize's ids come back whole.
        return JSONResponse({"prompt": engine.decode(request.tokens, skip_special_tokens=False)})

    return app
