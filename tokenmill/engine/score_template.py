"""The prompt a yes/no reranker scores for a (query, document) pair
(PoolerConfig.score_template). "qwen3_reranker" is Qwen3-Reranker's own format,
the strings vLLM's example builds: the instruction, query and document between
its chat prefix and suffix. Texts a client formatted already (the query begins
with the prefix, as vLLM's examples send them) are only concatenated, as vLLM
concatenates them, so the same request scores the same on both engines."""

from __future__ import annotations

QWEN3_RERANKER_PREFIX = (
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query '
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def score_prompt(query: str, document: str, template: str | None) -> str:
    """The one text a yes/no reranker runs for the pair."""
    if template is None or query.startswith(QWEN3_RERANKER_PREFIX):
        return query + document
    assert template == "qwen3_reranker", template
    return (f"{QWEN3_RERANKER_PREFIX}<Instruct>: {QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{QWEN3_RERANKER_SUFFIX}")
