"""Turn logits into tokens, for the whole batch at once.

One step, in vLLM's order (every stage is a tensor operation over the rows
that need it, never a Python loop over the vocabulary):

    raw logits ──> logprobs of the raw distribution (what users are shown)
        │
        ├─ allowed_token_ids, bad_words, min_tokens: banned tokens -> -inf
        ├─ logit_bias: added
        ├─ repetition / frequency / presence penalties
        │
        ├─ greedy rows: argmax
        └─ sampled rows: / temperature -> softmax -> min-p -> top-k -> top-p
                         -> inverse CDF with one uniform per row

Top-k / top-p need the most likely tokens in order; rather than sorting the
whole vocabulary, the top MAX_CANDIDATES are taken, which is exact whenever
they hold the whole top-k / top-p set (nearly always with a real model); the
other rows are redone with 16 times more, and at last with a full sort. Each draw uses exactly one uniform from
the request's own generator (seeded requests) or the shared one, so a seeded
request's tokens do not depend on what else shares the batch or on when it is
scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.backends.cpu.kernels import CpuOps
from tokenmill.core.contracts import SampledToken
from tokenmill.worker.request_state import CachedRequestState

NEG_INF = float("-inf")
# How many of the most likely tokens top-k / top-p look at before falling back to
# a full sort of the vocabulary (a sort of 256 x 49152 floats costs ~1 s on a CPU).
MAX_CANDIDATES = 256


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, raw distribution; NaN where not asked
    ranks: list[int]  # of each sampled token (1 = most likely); 0 where logprobs were not asked
    top_logprobs: list[dict[int, float] | None]  # top-k alternatives where asked, best first

    def rows(self) -> list[SampledToken]:
        """Each row's (token_id, logprob, rank, top_logprobs)."""
        return list(zip(self.token_ids, self.logprobs, self.ranks, self.top_logprobs, strict=True))


# ---- the stages, as functions of tensors (the tests compare them with transformers) ----


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab]; modified in place
    states: list[CachedRequestState],
    rows: list[int],  # the rows with penalties
) -> None:
    """Repetition penalty (CTRL: divide positive logits, multiply negative ones,
    for tokens of the prompt or the output), then OpenAI's frequency and
    presence penalties (generated tokens only). Sparse: only the tokens each
    request has seen are touched, (row, token) pairs flattened over the batch."""
    device = logits.device
    rep_rows: list[int] = []
    rep_tokens: list[int] = []
    rep_values: list[float] = []
    out_rows: list[int] = []
    out_tokens: list[int] = []
    out_values: list[float] = []  # count * frequency + presence
    for i in rows:
        state = states[i]
        params = state.params
        assert state.seen_token_ids is not None and state.output_counts is not None
        if params.repetition_penalty != 1.0:
            seen = state.seen_token_ids
            rep_rows.extend([i] * len(seen))
            rep_tokens.extend(seen)
            rep_values.extend([params.repetition_penalty] * len(seen))
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            counts = state.output_counts
            out_rows.extend([i] * len(counts))
            out_tokens.extend(counts.keys())
            out_values.extend(
                c * params.frequency_penalty + params.presence_penalty for c in counts.values()
            )
    if rep_rows:
        index = (torch.tensor(rep_rows, device=device), torch.tensor(rep_tokens, device=device))
        penalty = torch.tensor(rep_values, dtype=logits.dtype, device=device)
        values = logits[index]
        logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if out_rows:
        index = (torch.tensor(out_rows, device=device), torch.tensor(out_tokens, device=device))
        logits.index_put_(
            index, -torch.tensor(out_values, dtype=logits.dtype, device=device), accumulate=True
        )


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the top token's."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [rows, 1]
    return probs.masked_fill_(probs < threshold, 0.0)


def top_k_top_p_candidates(
    probs: torch.Tensor,  # [rows, vocab], not necessarily normalized
    top_k: torch.Tensor,  # [rows] int64, >= vocab = disabled
    top_p: torch.Tensor,  # [rows] float, 1.0 = disabled
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k then top-p filtered distribution over each row's
    `num_candidates` most likely tokens: (probs [rows, c], unnormalized, zero
    where filtered out; token ids [rows, c]; fits [rows] bool, False where the
    candidates do not hold the whole kept set and the row must be redone with
    num_candidates = vocab). Top-p keeps the smallest most-likely set whose mass
    reaches p of what top-k (and min-p) left, always at least one token."""
    num_candidates = min(num_candidates, probs.shape[-1])
    cand_probs, cand_ids = probs.topk(num_candidates, dim=-1)  # [rows, c], most likely first
    position = torch.arange(num_candidates, device=probs.device)
    cand_probs.masked_fill_(position[None, :] >= top_k[:, None], 0.0)
    cand_mass = cand_probs.sum(dim=-1)  # [rows]
    # The mass top-p is relative to: the top-k set when the candidates hold it all.
    k_inside = top_k <= num_candidates
    mass = torch.where(k_inside, cand_mass, probs.sum(dim=-1))  # [rows]
    threshold = top_p * mass
    cum_before = cand_probs.cumsum(dim=-1) - cand_probs  # mass of the more likely candidates
    drop = (cum_before >= threshold[:, None]) & (top_p < 1.0)[:, None]
    cand_probs.masked_fill_(drop, 0.0)
    # Exact when top-k cut inside the candidates or top-p's mass was reached within them.
    fits = k_inside | (cand_mass >= threshold)
    return cand_probs, cand_ids, fits


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row, the index where the cumulative (unnormalized) mass first
    exceeds u * total: a categorical draw from one uniform u in [0, 1)."""
    cdf = probs.cumsum(dim=-1)  # [rows, n]
    target = uniforms[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)  # [rows, 1]
    return index.clamp_(max=probs.shape[-1] - 1)[:, 0]


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
        for word in state.bad_words_token_ids:
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
    def __init__(
        self, device: torch.device, seed: int = 0, max_candidates: int = MAX_CANDIDATES,
        ops: CpuOps | None = None,
    ) -> None:
        self.device = device
        self.ops = ops  # the C++ kernels where the runner uses them (its argmax), else None
        self.max_candidates = max_candidates
        # Unseeded requests share this one; seeded ones have their own (in their state).
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32, raw; modified in place
        states: list[CachedRequestState],
        eos_token_ids: tuple[int, ...] = (),
    ) -> SamplerOutput:
        num_rows = logits.shape[0]
        if all(_plain_greedy(s) for s in states):  # (every stage below would do nothing)
            return SamplerOutput(argmax_rows(logits, self.ops).tolist(), [float("nan")] * num_rows,
                                 [0] * num_rows, [None] * num_rows)
        device = logits.device
        params = [s.params for s in states]

        # Raw logprobs, only for the rows that asked, before the logits change.
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        top: list[dict[int, float] | None] = [None] * num_rows
        if lp_rows:
            lp_index = torch.tensor(lp_rows, device=device)
            raw = logits[lp_index]  # [num_lp_rows, vocab], a copy
            logsumexp = raw.logsumexp(dim=-1, keepdim=True)  # [num_lp_rows, 1]
            max_top = max(params[i].logprobs or 0 for i in lp_rows)
            if max_top > 0:
                vals, ids = raw.topk(max_top, dim=-1)  # [num_lp_rows, max_top]
                vals = vals - logsumexp
                for i, row_vals, row_ids in zip(lp_rows, vals.tolist(), ids.tolist(), strict=True):
                    k = params[i].logprobs or 0
                    if k:
                        top[i] = dict(zip(row_ids[:k], row_vals[:k], strict=True))

        self.apply_logits_processors(logits, states, eos_token_ids)

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            token_ids = argmax_rows(logits, self.ops)  # [num_rows]
        elif len(random_rows) == num_rows:
            token_ids = self.sample(logits, states)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
            greedy = torch.tensor([i for i, p in enumerate(params) if p.greedy], device=device)
            token_ids[greedy] = argmax_rows(logits[greedy], self.ops)
            rows = torch.tensor(random_rows, device=device)
            token_ids[rows] = self.sample(logits[rows], [states[i] for i in random_rows])

        # The sampled token's raw logprob and rank; NaN / 0 where logprobs were not
        # asked for (computing them costs a pass over the vocabulary per row).
        chosen = [float("nan")] * num_rows
        ranks = [0] * num_rows
        if lp_rows:
            chosen_raw = raw.gather(1, token_ids[lp_index, None])  # [num_lp_rows, 1]
            lp_ranks = (raw >= chosen_raw).sum(dim=-1).tolist()
            for i, lp, rank in zip(lp_rows, (chosen_raw - logsumexp)[:, 0].tolist(), lp_ranks,
                                   strict=True):
                chosen[i], ranks[i] = lp, int(rank)
        return SamplerOutput(token_ids.tolist(), chosen, ranks, top)

    def apply_logits_processors(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]; modified in place
        states: list[CachedRequestState],
        eos_token_ids: tuple[int, ...],
    ) -> torch.Tensor:
        """Masks, bias and penalties, each on the rows that have them."""
        device = logits.device
        vocab = logits.shape[-1]
        params = [s.params for s in states]
        allow_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if allow_rows:
            index = torch.tensor(allow_rows, device=device)
            logits[index] = logits[index].masked_fill(
                allowed_mask(states, allow_rows, vocab, device), NEG_INF
            )
        ban_rows, ban_tokens = banned_tokens(states, eos_token_ids)
        if ban_rows:
            logits[torch.tensor(ban_rows, device=device),
                   torch.tensor(ban_tokens, device=device)] = NEG_INF
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias.keys())
                bias_values.extend(p.logit_bias.values())
        if bias_rows:
            logits.index_put_(
                (torch.tensor(bias_rows, device=device), torch.tensor(bias_tokens, device=device)),
                torch.tensor(bias_values, dtype=logits.dtype, device=device),
                accumulate=True,
            )
        penalty_rows = [i for i, s in enumerate(states) if s.output_counts is not None]
        if penalty_rows:
            apply_penalties(logits, states, penalty_rows)
        return logits

    def filtered_probs(
        self, logits: torch.Tensor, states: list[CachedRequestState]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Temperature, softmax, min-p: probs [rows, vocab] (unnormalized once
        min-p zeroes some), and the indices of the rows that top-k / top-p filter
        further (None if none do)."""
        device = logits.device
        params = [s.params for s in states]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        probs = torch.softmax(logits.div_(temperature[:, None]), dim=-1)  # [rows, vocab]
        if any(p.min_p > 0 for p in params):
            apply_min_p(probs, torch.tensor([p.min_p for p in params], device=device))
        vocab = logits.shape[-1]
        filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        return probs, torch.tensor(filtered, device=device) if filtered else None

    def sample(self, logits: torch.Tensor, states: list[CachedRequestState]) -> torch.Tensor:
        """Draw one token per row from processed logits [rows, vocab] (modified in place)."""
        device = logits.device
        vocab = logits.shape[-1]
        probs, filtered = self.filtered_probs(logits, states)
        uniforms = self.uniforms(states, device)  # [rows]
        if filtered is None:
            return inverse_cdf(probs, uniforms)

        token_ids = torch.empty(len(states), dtype=torch.int64, device=device)
        keep = torch.ones(len(states), dtype=torch.bool, device=device)
        keep[filtered] = False
        if bool(keep.any()):  # rows without top-k / top-p: the whole vocabulary
            plain = keep.nonzero()[:, 0]
            token_ids[plain] = inverse_cdf(probs[plain], uniforms[plain])
        params = [states[i].params for i in filtered.tolist()]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device)
        rows, num_candidates = filtered, self.max_candidates
        while True:
            cand_probs, cand_ids, fits = top_k_top_p_candidates(
                probs[rows], top_k, top_p, num_candidates
            )
            picked = cand_ids.gather(1, inverse_cdf(cand_probs, uniforms[rows])[:, None])[:, 0]
            token_ids[rows[fits]] = picked[fits]
            if bool(fits.all()):
                return token_ids
            # The candidates did not hold the whole kept set: redo those rows with
            # 16x more (a topk is far cheaper than a sort), at last the whole vocab.
            rows, top_k, top_p = rows[~fits], top_k[~fits], top_p[~fits]
            num_candidates = vocab if num_candidates * 16 >= vocab else num_candidates * 16

    def uniforms(self, states: list[CachedRequestState], device: torch.device) -> torch.Tensor:
        """One uniform per row in [0, 1): from the request's own generator when
        seeded, else from the shared one."""
        u = torch.rand(len(states), device=device, generator=self.default_generator)
        for i, state in enumerate(states):
            if state.generator is not None:
                u[i] = torch.rand(1, device=device, generator=state.generator)[0]
        return u


def _plain_greedy(state: CachedRequestState) -> bool:
    """Greedy with nothing that changes the logits and no logprobs asked: the
    token is the raw argmax (the common interactive case; ~50 us a step less)."""
    p = state.params
    return (p.greedy and p.logprobs is None and p.allowed_token_ids is None and not p.logit_bias
            and state.output_counts is None and not state.bad_words_token_ids
            and len(state.output_token_ids) >= p.min_tokens)


def argmax_rows(logits: torch.Tensor, ops: CpuOps | None) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) (first index of the maximum; NaN counts as
    largest); with `ops`, on the CPU a C++ kernel, 7x faster at [128, 49152]."""
    if (ops is not None and logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.is_contiguous() and logits.shape[1]):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)
