"""Turn logits into tokens, for the whole batch at once.

One step, in vLLM's order (every stage is a tensor operation over the rows
that need it, never a loop over the vocabulary):

    raw logits ──> logprobs of the raw distribution (what users are shown)
        │
        ├─ allowed_token_ids, bad_words, min_tokens: banned tokens -> -inf
        ├─ logit_bias: added
        ├─ repetition / frequency / presence penalties
        │
        ├─ greedy rows: argmax
        └─ sampled rows: / temperature -> min-p -> top-k -> top-p -> softmax
                         -> exponential race: argmax(p / q), q ~ Exp(1)

The exponential race equals a categorical draw and lets each seeded request
draw q from its own generator, so its tokens do not depend on what else
shares the batch or on when it is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.worker.request_state import CachedRequestState

NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the raw distribution
    ranks: list[int]  # of each sampled token (1 = most likely); 0 where logprobs were not asked
    top_logprobs: list[dict[int, float] | None]  # top-k alternatives where asked, best first


# ---- the stages, as functions of tensors (the tests compare them with transformers) ----


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab]
    prompt_mask: torch.Tensor,  # [rows, vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor,  # [rows, vocab] float: times the token was generated
    presence: torch.Tensor,  # [rows]
    frequency: torch.Tensor,  # [rows]
    repetition: torch.Tensor,  # [rows]
) -> torch.Tensor:
    """Repetition penalty (CTRL: divide positive logits, multiply negative ones, for
    tokens of the prompt or the output) then OpenAI's frequency and presence
    penalties (generated tokens only)."""
    output_mask = output_counts > 0
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | output_mask, penalized, logits)
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * output_mask
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = torch.softmax(logits, dim=-1)  # [rows, vocab]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [rows, vocab]
    top_k: torch.Tensor | None,  # [rows] int64, vocab = disabled
    top_p: torch.Tensor | None,  # [rows] float, 1.0 = disabled
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose mass reaches p
    (always at least one token)."""
    vocab = logits.shape[-1]
    if top_p is None:
        if top_k is None:
            return logits
        # Top-k alone needs no full sort: the k-th largest value is the threshold.
        max_k = int(top_k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k.clamp(max=max_k) - 1)[:, None])
        kth = kth.masked_fill((top_k >= vocab)[:, None], NEG_INF)  # [rows, 1]
        return logits.masked_fill(logits < kth, NEG_INF)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)  # [rows, vocab]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])  # [rows, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, NEG_INF)
    cum_probs = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cum_probs <= 1 - top_p[:, None]  # the low tail holding at most 1 - p of the mass
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def banned_tokens(
    states: list[CachedRequestState], eos_token_ids: tuple[int, ...]
) -> tuple[list[int], list[int]]:
    """(row, token) pairs that must not be sampled: bad words about to be
    completed, and EOS / stop tokens before min_tokens."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, state in enumerate(states):
        params = state.params
        output = state.output_token_ids
        for word in params.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or output[len(output) - len(prefix) :] == prefix:
                rows.append(i)
                tokens.append(word[-1])
        if len(output) < params.min_tokens:
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids.extend(eos_token_ids)
            rows.extend([i] * len(stop_ids))
            tokens.extend(stop_ids)
    return rows, tokens


def allowed_mask(states: list[CachedRequestState], rows: list[int], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] bool: True where the token is NOT allowed."""
    mask = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for j, i in enumerate(rows):
        allowed = states[i].params.allowed_token_ids or []
        row_idx.extend([j] * len(allowed))
        tok_idx.extend(allowed)
    mask[torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)] = False
    return mask


# ---- the sampler ----------------------------------------------------------------------


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        # Unseeded requests share this one; seeded ones have their own (in their state).
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32, raw
        states: list[CachedRequestState],
        eos_token_ids: tuple[int, ...] = (),
    ) -> SamplerOutput:
        num_rows = logits.shape[0]
        device = logits.device
        params = [s.params for s in states]
        logsumexp = logits.logsumexp(dim=-1)  # [num_rows]

        # Raw top-k alternatives, before anything below changes the logits.
        top: list[dict[int, float] | None] = [None] * num_rows
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        max_top = max((params[i].logprobs or 0 for i in lp_rows), default=0)
        if max_top > 0:
            lp_index = torch.tensor(lp_rows, device=device)
            vals, ids = logits[lp_index].topk(max_top, dim=-1)  # [num_lp_rows, max_top]
            vals = vals - logsumexp[lp_index, None]
            for j, (row_vals, row_ids) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True)):
                k = params[lp_rows[j]].logprobs or 0
                if k:
                    top[lp_rows[j]] = dict(zip(row_ids[:k], row_vals[:k], strict=True))

        processed = self.apply_logits_processors(logits, states, eos_token_ids)

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) < num_rows:
            token_ids = processed.argmax(dim=-1)  # [num_rows]
        else:
            token_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)
        if random_rows:
            rows = torch.tensor(random_rows, device=device)
            drawn = self.sample(processed[rows], [states[i] for i in random_rows])
            if len(random_rows) == num_rows:
                token_ids = drawn
            else:
                token_ids[rows] = drawn

        chosen_logits = logits.gather(1, token_ids[:, None])  # [num_rows, 1], raw
        chosen = (chosen_logits[:, 0] - logsumexp).tolist()
        ranks = [0] * num_rows
        if lp_rows:
            lp_index = torch.tensor(lp_rows, device=device)
            lp_ranks = (logits[lp_index] >= chosen_logits[lp_index]).sum(dim=-1).tolist()
            for i, r in zip(lp_rows, lp_ranks, strict=True):
                ranks[i] = int(r)
        return SamplerOutput(token_ids.tolist(), chosen, ranks, top)

    def apply_logits_processors(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] raw; not modified
        states: list[CachedRequestState],
        eos_token_ids: tuple[int, ...],
    ) -> torch.Tensor:  # [num_rows, vocab], a copy when anything applies
        device = logits.device
        vocab = logits.shape[-1]
        params = [s.params for s in states]
        allow_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        ban_rows, ban_tokens = banned_tokens(states, eos_token_ids)
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias.keys())
                bias_values.extend(p.logit_bias.values())
        penalty_rows = [i for i, s in enumerate(states) if s.output_counts is not None]
        if not (allow_rows or ban_rows or bias_rows or penalty_rows):
            return logits

        x = logits.clone()
        if allow_rows:
            index = torch.tensor(allow_rows, device=device)
            x[index] = x[index].masked_fill(allowed_mask(states, allow_rows, vocab, device), NEG_INF)
        if ban_rows:
            x[torch.tensor(ban_rows, device=device), torch.tensor(ban_tokens, device=device)] = NEG_INF
        if bias_rows:
            x.index_put_(
                (torch.tensor(bias_rows, device=device), torch.tensor(bias_tokens, device=device)),
                torch.tensor(bias_values, dtype=x.dtype, device=device),
                accumulate=True,
            )
        if penalty_rows:
            index = torch.tensor(penalty_rows, device=device)
            pstates = [states[i] for i in penalty_rows]
            x[index] = apply_penalties(
                x[index],
                torch.stack([s.prompt_mask for s in pstates]),  # type: ignore[misc]
                torch.stack([s.output_counts for s in pstates]),  # type: ignore[misc]
                torch.tensor([s.params.presence_penalty for s in pstates], device=device),
                torch.tensor([s.params.frequency_penalty for s in pstates], device=device),
                torch.tensor([s.params.repetition_penalty for s in pstates], device=device),
            )
        return x

    def sample(self, logits: torch.Tensor, states: list[CachedRequestState]) -> torch.Tensor:
        """Draw one token per row from processed logits [rows, vocab] (a copy we own)."""
        device = logits.device
        vocab = logits.shape[-1]
        params = [s.params for s in states]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        x = logits.div_(temperature[:, None])
        if any(p.min_p > 0 for p in params):
            x = apply_min_p(x, torch.tensor([p.min_p for p in params], device=device))
        top_k = None
        if any(0 < p.top_k < vocab for p in params):
            top_k = torch.tensor(
                [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device
            )
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=device)
        x = apply_top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)  # [rows, vocab]

        q = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(states) if s.generator is None]
        if len(unseeded) == len(states):
            q.exponential_(generator=self.default_generator)
        elif unseeded:
            q[unseeded] = torch.empty(
                (len(unseeded), vocab), device=device
            ).exponential_(generator=self.default_generator)
        for i, state in enumerate(states):
            if state.generator is not None:
                q[i].exponential_(generator=state.generator)
        return probs.div_(q).argmax(dim=-1)
