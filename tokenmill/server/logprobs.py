"""Prompt logprobs in the server's answers: OpenAI's legacy completion shape for
`echo` + `logprobs`, and vLLM's extra `prompt_logprobs` field.

The legacy shape (what lm-evaluation-harness scores with) runs over prompt and
completion together: `tokens`, `token_logprobs` (the first is null: nothing
predicts the first prompt token), `top_logprobs` (null there too), and
`text_offset`, each token's start counted in token-text lengths, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.outputs import Logprob, PromptLogprobs
from tokenmill.server.protocol import CompletionLogprobs, PromptLogprobEntry
from tokenmill.server.serving import Serving

# JSON has no -inf: OpenAI's (and vLLM's) floor for a logprob in an answer.
MIN_LOGPROB = -9999.0


def clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def top_k_of(position: dict[int, Logprob], token_id: int, k: int) -> dict[int, Logprob]:
    """The prompt token itself and the k most likely ones (the engine may have
    computed more: echo and an explicit prompt_logprobs share one request)."""
    return {t: lp for t, lp in position.items()
            if t == token_id or (lp.rank is not None and lp.rank <= k)}


def echo_logprobs(
    serving: Serving, prompt_token_ids: Sequence[int], prompt_logprobs: PromptLogprobs, k: int
) -> tuple[CompletionLogprobs, int]:
    """The prompt's part of the legacy shape with `k` top alternatives per
    token, and the text offset where the completion's tokens start."""
    lp = CompletionLogprobs()
    offset = 0
    for token_id, position in zip(prompt_token_ids, prompt_logprobs, strict=True):
        token = serving.token_text(token_id)
        lp.tokens.append(token)
        lp.text_offset.append(offset)
        offset += len(token)
        if position is None:  # the first prompt token
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(clamp(position[token_id].logprob))
        ranked = sorted(top_k_of(position, token_id, k).items(), key=lambda kv: -kv[1].logprob)
        lp.top_logprobs.append({serving.token_text(t): clamp(v.logprob) for t, v in ranked})
    return lp, offset


def join(first: CompletionLogprobs | None, then: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Two runs of the legacy shape, one after the other (a streamed choice's first
    chunk: its prompt's logprobs, then its first tokens')."""
    if first is None or then is None:
        return first if then is None else then
    return CompletionLogprobs(
        tokens=[*first.tokens, *then.tokens],
        token_logprobs=[*first.token_logprobs, *then.token_logprobs],
        top_logprobs=[*first.top_logprobs, *then.top_logprobs],
        text_offset=[*first.text_offset, *then.text_offset],
    )


def prompt_logprobs_field(
    serving: Serving, prompt_token_ids: Sequence[int], prompt_logprobs: PromptLogprobs, k: int
) -> list[dict[int, PromptLogprobEntry] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token, null for the first, else
    {token id: {logprob, rank, decoded_token}} for the token and its top k."""
    field: list[dict[int, PromptLogprobEntry] | None] = []
    for token_id, position in zip(prompt_token_ids, prompt_logprobs, strict=True):
        if position is None:
            field.append(None)
            continue
        field.append({
            t: PromptLogprobEntry(
                logprob=clamp(v.logprob), rank=v.rank,
                decoded_token=v.decoded_token if v.decoded_token is not None else serving.token_text(t),
            )
            for t, v in top_k_of(position, token_id, k).items()
        })
    return field
