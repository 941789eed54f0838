"""tokenmill: a readable LLM inference engine with continuous batching."""

from typing import TYPE_CHECKING

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "RequestOutputKind", "SamplingParams"]


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
