"""Speculative decoding in the runner: the drafter interface and verification.

Verification, for drafts d_1..d_k of a request whose rows 0..k are sampled
from the target's logits at positions p..p+k (row i already sees d_1..d_i):

    x_i = the token the sampler draws at row i (greedy: argmax; else its one
          uniform u_i through the request's processed distribution)
    accept d_1..d_a while x_{i-1} == d_i; the run is x_0..x_a (a accepted
    drafts, then the target's own token at the first mismatch, or a bonus one)

This is Leviathan et al. / Chen et al.'s rejection sampling for a one-hot
draft distribution q (both proposers draft deterministically: n-gram lookup
and a draft model's argmax): a draft d is accepted with probability
min(1, p(d) / q(d)) = p(d), and on rejection the token comes from
norm(max(p - q, 0)) = p without d. Drawing x ~ p and accepting when x == d does
both with one uniform, and every kept token is exactly the token decoding one
at a time would have drawn with the same uniform: greedy output is unchanged
and a seeded request's too (its generator is advanced one draw per kept token).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from tokenmill.core.contracts import SampledToken, ScheduledRequest
from tokenmill.worker.request_state import CachedRequestState


class Drafter(Protocol):
    """Proposes drafts inside the runner, before the target's forward (a draft
    model; an EAGLE-style head would take the target's hidden states from the
    last step as well)."""

    def propose(self, reqs: list[ScheduledRequest], histories: list[list[int]]) -> None:
        """Replace each request's last `num_draft_tokens` token ids (placeholders)
        with drafts; `histories`: each request's tokens (prompt + output, its new
        token last). Its KV writes must stay in the request's scheduled slots."""
        ...

    def forget(self, request_id: str) -> None:
        """The request was preempted or finished: its blocks are gone."""
        ...


def speculative_row_states(
    state: CachedRequestState, drafts: list[int]
) -> list[CachedRequestState]:
    """The state each of a request's 1 + k sampled rows is sampled under: row i
    as if d_1..d_i were already output (min_tokens' EOS ban and bad words look
    at the output). They share the request's generator, so row i takes its
    (i+1)-th next uniform, as the (i+1)-th token decoded alone would."""
    assert state.grammar is None and state.output_counts is None, "not speculated on"
    rows = [state]
    for i in range(1, len(drafts) + 1):
        rows.append(dataclasses.replace(state, output_token_ids=[*state.output_token_ids,
                                                                 *drafts[:i]]))
    return rows


def verify_drafts(
    rows: list[SampledToken],  # one per sampled row: 1 + num_draft_tokens per request
    reqs: list[ScheduledRequest],  # the sampled requests, in row order
) -> list[list[SampledToken]]:
    """Per request, its run: the drafts it accepted (the target's rows that drew
    them, with the target's logprobs), then the target's own token after them."""
    runs: list[list[SampledToken]] = []
    row = 0
    for r in reqs:
        k = r.num_draft_tokens
        drafts = r.token_ids[len(r.token_ids) - k :]
        num_accepted = 0
        while num_accepted < k and rows[row + num_accepted][0] == drafts[num_accepted]:
            num_accepted += 1
        runs.append(rows[row : row + num_accepted + 1])
        row += k + 1
    assert row == len(rows)
    return runs
