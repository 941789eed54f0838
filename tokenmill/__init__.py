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
    from tokenmill.model.source import default_model_path, gemma3_270m_path

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
    "gemma3_270m_path",
]


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "default_model_path":
        from tokenmill.model.source import default_model_path, gemma3_270m_path

        return default_model_path
    if name == "gemma3_270m_path":  # the real Gemma 3 270M Q4_K_M file (`make setup` installs it)
        from tokenmill.model.source import gemma3_270m_path

        return gemma3_270m_path
    raise AttributeError(name)
