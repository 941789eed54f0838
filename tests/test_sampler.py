"""The batched sampler against transformers' logits processors, on random logits.

Each stage (penalties, logit bias, bad words, min_tokens, temperature, min-p,
top-k, top-p) must give the same processed logits as transformers' own
processor applied row by row; reported logprobs are the raw distribution's;
the empirical distribution of many draws matches the filtered softmax
(chi-square, fixed seed: deterministic, and shown able to fail); a seeded row
draws the same tokens whatever shares its batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.sampler import Sampler, top_k_top_p_candidates

CPU = torch.device("cpu")
VOCAB = 1000
EOS = (2,)


def make_state(
    params: SamplingParams,
    prompt: list[int],
    output: list[int] = (),  # type: ignore[assignment]
    request_id: str = "r",
    vocab: int = VOCAB,
) -> CachedRequestState:
    state = CachedRequestState.create(request_id, prompt, params, vocab, CPU)
    for t in output:
        state.append_output(t)
    return state


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3.0


def random_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "different tokens filtered out"
    finite = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-5, atol=1e-5)


# ---- penalties ----------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = random_logits(6)
    histories = [(random_ids(20, 10 + i), random_ids(i * 3, 20 + i)) for i in range(6)]
    states = [
        make_state(SamplingParams(repetition_penalty=penalty), p, o) for p, o in histories
    ]
    ours = Sampler(CPU).apply_logits_processors(logits.clone(), states, EOS)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (prompt, output) in enumerate(histories):
        theirs = hf(torch.tensor([prompt + output]), logits[i : i + 1].clone())
        assert_same_logits(ours[i : i + 1], theirs)


def test_frequency_and_presence_penalties_follow_openai() -> None:
    # OpenAI's definition: logit - count * frequency - (count > 0) * presence, over
    # generated tokens only (transformers has no processor for these).
    logits = random_logits(4)
    prompt = random_ids(30, 1)
    output = [5, 5, 5, 7, 9, 9, prompt[0]]
    params = [(0.5, 0.0), (0.0, 0.7), (-1.0, 1.5), (2.0, -2.0)]
    states = [
        make_state(SamplingParams(presence_penalty=pp, frequency_penalty=fp), prompt, output)
        for pp, fp in params
    ]
    ours = Sampler(CPU).apply_logits_processors(logits.clone(), states, EOS)
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    for i, (pp, fp) in enumerate(params):
        expected = logits[i] - fp * counts - pp * (counts > 0).float()
        torch.testing.assert_close(ours[i], expected)


# ---- bias and masks ---------------------------------------------------------------------


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    logits = random_logits(3)
    biases = [{5: 10.0, 17: -100.0}, {}, {999: 3.5, 0: -0.25}]
    states = [
        make_state(SamplingParams(logit_bias=b or None), [1, 2, 3]) for b in biases
    ]
    ours = Sampler(CPU).apply_logits_processors(logits.clone(), states, EOS)
    for i, bias in enumerate(biases):
        theirs = logits[i : i + 1].clone()
        if bias:
            hf = SequenceBiasLogitsProcessor(sequence_bias=[[[t], v] for t, v in bias.items()])
            theirs = hf(torch.tensor([[1, 2, 3]]), theirs)
        assert_same_logits(ours[i : i + 1], theirs)


def test_bad_words_match_transformers() -> None:
    # vLLM's rule: a multi-token bad word's last token is banned when the output so
    # far ends with the rest of the word; a one-token bad word is always banned.
    bad = [[7], [11, 12], [20, 21, 22]]
    outputs = [[1, 11], [20, 21], [21, 20], [], [11, 20, 21]]
    logits = random_logits(len(outputs))
    states = []
    for out in outputs:
        # The engine tokenizes bad_words and hands the ids to the runner with the request.
        state = CachedRequestState.create("r", [3, 4], SamplingParams(bad_words=["unused"]), VOCAB,
                                          CPU, bad_words_token_ids=bad)
        for t in out:
            state.append_output(t)
        states.append(state)
    ours = Sampler(CPU).apply_logits_processors(logits.clone(), states, EOS)
    hf = NoBadWordsLogitsProcessor(bad, eos_token_id=EOS[0])
    for i, out in enumerate(outputs):
        theirs = hf(torch.tensor([[3, 4, *out]]) if out else torch.tensor([[3, 4]]),
                    logits[i : i + 1].clone())
        # transformers looks at prompt + output; these prompts end no bad word.
        assert_same_logits(ours[i : i + 1], theirs)


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = random_logits(4)
    prompt = [5, 6, 7]
    cases = [  # (params, output so far)
        (SamplingParams(min_tokens=3), [9]),
        (SamplingParams(min_tokens=3), [9, 9, 9]),
        (SamplingParams(min_tokens=2, stop_token_ids=[40, 41]), [9]),
        (SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[40]), []),
    ]
    states = [make_state(p, prompt, o) for p, o in cases]
    ours = Sampler(CPU).apply_logits_processors(logits.clone(), states, EOS)
    for i, (params, out) in enumerate(cases):
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(EOS))
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stop_ids)
        theirs = hf(torch.tensor([prompt + out]), logits[i : i + 1].clone())
        assert_same_logits(ours[i : i + 1], theirs)
    assert torch.isinf(ours[0, 2]) and not torch.isinf(ours[1, 2])


def test_allowed_token_ids_leave_only_those() -> None:
    logits = random_logits(2)
    states = [
        make_state(SamplingParams(allowed_token_ids=[3, 500, 999]), [1]),
        make_state(SamplingParams(), [1]),
    ]
    ours = Sampler(CPU).apply_logits_processors(logits.clone(), states, EOS)
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [3, 500, 999]
    torch.testing.assert_close(ours[0, [3, 500, 999]], logits[0, [3, 500, 999]])
    torch.testing.assert_close(ours[1], logits[1])
    out = Sampler(CPU)(logits, states, EOS)
    assert out.token_ids[0] in (3, 500, 999)


# ---- temperature, min-p, top-k, top-p ---------------------------------------------------

FILTERS = [  # (temperature, min_p, top_k, top_p)
    (1.0, 0.0, 0, 1.0),
    (0.7, 0.0, 50, 1.0),
    (1.3, 0.0, 0, 0.9),
    (0.5, 0.1, 0, 1.0),
    (1.0, 0.05, 20, 0.8),
    (2.0, 0.0, 1, 0.5),
    (0.9, 0.2, 7, 0.95),
    (1.0, 0.0, 999, 0.3),
]


def hf_filtered(logits: torch.Tensor, temperature: float, min_p: float, top_k: int,
                top_p: float) -> torch.Tensor:
    """transformers' warpers, in vLLM's order: temperature, min-p, top-k, top-p."""
    ids = torch.tensor([[0]])
    x = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    if min_p > 0:
        x = MinPLogitsWarper(min_p)(ids, x)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(ids, x)
    return x


def our_filtered(
    logits: torch.Tensor, params: list[SamplingParams], num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our temperature / min-p / top-k / top-p as normalized probabilities [rows, vocab],
    and which rows the candidates held exactly (the others need a full sort)."""
    vocab = logits.shape[-1]
    states = [make_state(p, [1], request_id=str(i), vocab=vocab) for i, p in enumerate(params)]
    probs, filtered = Sampler(CPU).filtered_probs(logits.clone(), states)
    fits = torch.ones(len(params), dtype=torch.bool)
    if filtered is not None:
        top_k = torch.tensor([params[i].top_k or vocab for i in filtered.tolist()])
        top_p = torch.tensor([params[i].top_p for i in filtered.tolist()])
        cand_probs, cand_ids, cand_fits = top_k_top_p_candidates(
            probs[filtered], top_k, top_p, num_candidates
        )
        probs[filtered] = torch.zeros(len(filtered), vocab).scatter_(1, cand_ids, cand_probs)
        fits[filtered] = cand_fits
    return probs / probs.sum(dim=-1, keepdim=True), fits


def filter_params(f: tuple[float, float, int, float]) -> SamplingParams:
    return SamplingParams(temperature=f[0], min_p=f[1], top_k=f[2], top_p=f[3])


@pytest.mark.parametrize("num_candidates", [VOCAB, 64])
def test_filters_match_transformers_warpers(num_candidates: int) -> None:
    logits = random_logits(len(FILTERS), seed=5)
    ours, fits = our_filtered(logits, [filter_params(f) for f in FILTERS], num_candidates)
    if num_candidates < VOCAB:  # both the candidate path and the fallback are exercised
        assert fits.any() and not fits.all()
    for i, f in enumerate(FILTERS):
        theirs = torch.softmax(hf_filtered(logits[i : i + 1], *f), dim=-1)[0]
        if not fits[i]:
            continue  # the sampler redoes this row with all candidates (the case above)
        assert torch.equal(ours[i] > 0, theirs > 0), f"row {i}: different tokens kept"
        torch.testing.assert_close(ours[i], theirs, rtol=1e-4, atol=1e-7)


def test_top_k_alone_matches_transformers() -> None:
    logits = random_logits(4, seed=6)
    ks = [1, 10, VOCAB - 1, 300]
    ours, _ = our_filtered(logits, [SamplingParams(top_k=k) for k in ks], VOCAB)
    for i, k in enumerate(ks):
        theirs = TopKLogitsWarper(k)(torch.tensor([[0]]), logits[i : i + 1].clone())
        theirs = torch.softmax(theirs, dim=-1)[0]
        assert torch.equal(ours[i] > 0, theirs > 0)
        torch.testing.assert_close(ours[i], theirs, rtol=1e-4, atol=1e-7)


# ---- logprobs, greedy, mixed batches ------------------------------------------------------


def test_logprobs_are_the_raw_distribution() -> None:
    logits = random_logits(5, seed=7)
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_k=10, logprobs=0, seed=3),
        SamplingParams(temperature=1.0, logprobs=20, logit_bias={1: 50.0}),
        SamplingParams(temperature=0.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
    ]
    states = [make_state(p, random_ids(10, i), random_ids(4, 50 + i), f"r{i}")
              for i, p in enumerate(params)]
    out = Sampler(CPU)(logits.clone(), states, EOS)
    raw = torch.log_softmax(logits, dim=-1)
    for i, p in enumerate(params):
        tok = out.token_ids[i]
        if p.logprobs is None:  # not computed
            assert out.top_logprobs[i] is None and math.isnan(out.logprobs[i])
            continue
        assert abs(out.logprobs[i] - raw[i, tok].item()) < 1e-4
        assert out.ranks[i] == int((raw[i] >= raw[i, tok]).sum())
        top = out.top_logprobs[i] if p.logprobs else {}
        assert top is not None
        vals, ids = raw[i].topk(p.logprobs) if p.logprobs else (torch.empty(0), torch.empty(0))
        assert list(top) == ids.tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), vals, atol=1e-4, rtol=0)
    assert out.token_ids[2] == 1  # the +50 bias wins


def test_greedy_rows_take_argmax_of_processed_logits() -> None:
    logits = random_logits(3, seed=8)
    prompt = [int(logits[0].argmax())]  # the top token is repeated: a penalty may demote it
    states = [
        make_state(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt),
        make_state(SamplingParams(temperature=0.7, seed=1), prompt, request_id="b"),
        make_state(SamplingParams(temperature=0.0), prompt, request_id="c"),
    ]
    out = Sampler(CPU)(logits.clone(), states, EOS)
    processed = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([prompt]), logits[:1].clone())
    assert out.token_ids[0] == int(processed.argmax())
    assert out.token_ids[2] == int(logits[2].argmax())


def test_seeded_row_is_independent_of_its_batch() -> None:
    logits = random_logits(1, seed=9)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def draws(batch_size: int, position: int, steps: int = 20) -> list[int]:
        target = make_state(params, [1, 2], request_id="target")
        others = [make_state(SamplingParams(temperature=0.9, seed=None if j % 2 else j),
                             [1], request_id=f"o{j}") for j in range(batch_size - 1)]
        sampler = Sampler(CPU, seed=batch_size)
        tokens = []
        for _ in range(steps):
            states = [*others[:position], target, *others[position:]]
            batch = random_logits(batch_size, seed=len(tokens) + 100)
            batch[position] = logits[0]
            out = sampler(batch, states, EOS)
            tokens.append(out.token_ids[position])
        return tokens

    alone = draws(1, 0)
    assert draws(64, 17) == alone
    assert draws(8, 7) == alone
    assert len(set(alone)) > 3  # it really samples


# ---- the distribution ------------------------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test over the support of expected_probs."""
    support = expected_probs > 0
    assert int(counts[~support].sum()) == 0, "drew a token the filters removed"
    n = counts.sum()
    expected = expected_probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


SMALL_VOCAB = 12
NUM_DRAWS = 40_000


@pytest.mark.parametrize("max_candidates", [256, 3])  # 3: the full-sort fallback too
@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 6},
        {"temperature": 1.2, "top_p": 0.8},
        {"temperature": 0.9, "min_p": 0.1, "top_k": 8, "top_p": 0.9},
        {"temperature": 0.9, "top_k": 2, "top_p": 0.9},
    ],
)
def test_draws_follow_the_filtered_softmax(kwargs: dict[str, Any], max_candidates: int) -> None:
    logits = torch.linspace(-2.0, 2.0, SMALL_VOCAB)[torch.randperm(
        SMALL_VOCAB, generator=torch.Generator().manual_seed(0))]
    params = SamplingParams(**kwargs)
    expected = torch.softmax(
        hf_filtered(logits[None], params.temperature, params.min_p, params.top_k, params.top_p)[0],
        dim=-1,
    )
    # Unseeded rows: one batched draw from the sampler's default generator.
    states = [make_state(params, [1], request_id=str(i), vocab=SMALL_VOCAB)
              for i in range(NUM_DRAWS)]
    sampler = Sampler(CPU, seed=42, max_candidates=max_candidates)
    out = sampler(logits.expand(NUM_DRAWS, -1).clone(), states, EOS)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=SMALL_VOCAB)
    assert chi_square_p_value(counts, expected) > 1e-3
    # The test can fail: a different temperature without the filters is rejected.
    wrong = torch.softmax(logits / (params.temperature * 1.3), dim=-1)
    assert chi_square_p_value(counts, wrong) < 1e-6


def test_seeded_draws_follow_the_softmax() -> None:
    logits = torch.linspace(-1.5, 1.5, SMALL_VOCAB)
    state = make_state(SamplingParams(temperature=0.8, seed=7), [1], vocab=SMALL_VOCAB)
    sampler = Sampler(CPU)
    tokens = [sampler(logits[None].clone(), [state], EOS).token_ids[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=SMALL_VOCAB)
    assert chi_square_p_value(counts, torch.softmax(logits / 0.8, dim=-1)) > 1e-3
