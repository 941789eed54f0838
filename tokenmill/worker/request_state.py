"""What the runner remembers about each request between steps.

The scheduler sends only this step's tokens (and the prompt when it admits a
request), so the runner keeps, per request: the prompt, the tokens it has
sampled for it, the request's random generator (seeded requests), the
penalty bookkeeping, the prompt logprobs gathered so far and its grammar
matcher (structured outputs). The state
survives preemption (a recomputed request is the same request: its history
and generator go on where they were) and is dropped when the request finishes.

Tokens are appended here only when the runner samples them, never from the
scheduled token ids, so a recompute after preemption counts nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.core.contracts import TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.grammar import RequestGrammar


@dataclass(eq=False)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # seeded requests only
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Penalties only (kept sparse: a request sees far fewer tokens than the vocab):
    # the distinct tokens of prompt + output, and how often each was sampled.
    seen_token_ids: list[int] | None = None
    output_counts: dict[int, int] | None = None
    _seen: set[int] = field(default_factory=set, repr=False)
    # prompt_logprobs only: entries for prompt positions 1.. gathered so far (a
    # chunked prefill delivers them a chunk at a time), and whether they were sent.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # structured_outputs only: the grammar matcher, advanced with each sampled token
    # (worker/grammar.py), so it survives preemption with the rest of this state.
    grammar: RequestGrammar | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        vocab_size: int,
        device: torch.device,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> CachedRequestState:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        state = cls(request_id, list(prompt_token_ids), params, generator, bad_words_token_ids or [])
        if params.has_penalties:
            state._seen = {t for t in prompt_token_ids if t < vocab_size}
            state.seen_token_ids = sorted(state._seen)
            state.output_counts = {}
        return state

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.output_counts is not None and self.seen_token_ids is not None:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
            if token_id not in self._seen:
                self._seen.add(token_id)
                self.seen_token_ids.append(token_id)
