"""tokenmill: a readable LLM inference engine with continuous batching."""

from typing import TYPE_CHECKING

from tokenmill.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.sampling_params import (
    LoRARequest,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.model.source import default_model_path

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "default_model_path",
]


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "default_model_path":
        from tokenmill.model.source import default_model_path

        return default_model_path
    raise AttributeError(name)
