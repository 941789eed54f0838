"""Sampling through the whole engine, on a tiny random Llama (transformers as oracle).

A seeded request gives the same tokens alone and inside a crowd of 64 others
with chunked prefill and preemption forced; its reported logprobs are
transformers' log_softmax of the raw logits. n > 1 samples share the prompt's
blocks, are reproducible, stream as deltas and abort together. Prompt
logprobs match transformers under chunking and preemption, and min_tokens
holds EOS and stop tokens back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.hf_models import TEST_DEVICE, VOCAB_SIZE, build_hf_model, save_hf_model
from tokenmill import LLM, RequestOutput, SamplingParams
from tokenmill.sampling_params import MAX_SEED, MIN_SEED, RequestOutputKind

EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, str]:
    model = build_hf_model("llama")
    return model, save_hf_model(model, Path(tmp_path_factory.mktemp("llama")))


def make_llm(path: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 512)
    return LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
               check_integrity=True, **kwargs)


def ids(prompt: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": prompt}


@torch.inference_mode()
def hf_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row p is transformers' log_softmax predicting token p + 1."""
    logits = model(torch.tensor([tokens])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def assert_all_free(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert not scheduler.requests
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks


TARGET_PROMPT = np.random.default_rng(7).integers(3, VOCAB_SIZE, size=30).tolist()
TARGET = SamplingParams(
    temperature=0.9, top_p=0.9, top_k=50, presence_penalty=0.3, repetition_penalty=1.1,
    seed=77, max_tokens=24, ignore_eos=True, logprobs=2,
)


def crowd(rng: np.random.Generator, size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(size):
        prompts.append(rng.integers(3, VOCAB_SIZE, size=int(rng.integers(4, 50))).tolist())
        kind = i % 4
        params.append(SamplingParams(
            temperature=0.0 if kind == 0 else float(rng.uniform(0.5, 1.5)),
            top_p=float(rng.uniform(0.5, 1.0)) if kind == 1 else 1.0,
            min_p=0.05 if kind == 2 else 0.0,
            frequency_penalty=0.5 if kind == 3 else 0.0,
            logit_bias={int(rng.integers(3, VOCAB_SIZE)): 2.0} if kind == 2 else None,
            seed=int(rng.integers(1 << 30)) if i % 3 == 0 else None,
            max_tokens=int(rng.integers(2, 16)),
            ignore_eos=True,
        ))
    return prompts, params


def test_seeded_request_alone_and_in_a_crowd_gives_identical_tokens(
    model_dir: tuple[torch.nn.Module, str],
) -> None:
    model, path = model_dir
    alone = make_llm(path).generate([ids(TARGET_PROMPT)], TARGET, use_tqdm=False)[0].outputs[0]

    prompts, params = crowd(np.random.default_rng(0), 64)
    llm = make_llm(path, max_num_batched_tokens=16, num_kv_blocks=24, block_size=4, seed=5)
    # At position 4 the target is among the first admitted and, as the KV pool
    # runs short, preempted (checked below: the setup is deterministic).
    pos = 4
    outs = llm.generate(
        [ids(p) for p in [*prompts[:pos], TARGET_PROMPT, *prompts[pos:]]],
        [*params[:pos], TARGET, *params[pos:]],
        use_tqdm=False,
    )
    target = outs[pos]
    assert target.metrics is not None and target.metrics.num_preemptions > 0
    assert llm.last_generate_stats.num_preemptions > 0
    assert target.outputs[0].token_ids == alone.token_ids
    assert len(set(alone.token_ids)) > 5  # it really samples
    assert_all_free(llm)

    # The reported logprobs are the raw model distribution's (transformers' log_softmax).
    ref = hf_logprobs(model, TARGET_PROMPT + alone.token_ids[:-1])[len(TARGET_PROMPT) - 1 :]
    assert alone.logprobs is not None
    for step, (entry, tok) in enumerate(zip(alone.logprobs, alone.token_ids, strict=True)):
        assert abs(entry[tok].logprob - ref[step, tok].item()) < 1e-4
        assert entry[tok].rank == int((ref[step] >= ref[step, tok]).sum())
        top_ids = ref[step].topk(2).indices.tolist()
        assert set(entry) == {tok, *top_ids}
        assert [entry[t].rank for t in top_ids] == [1, 2]
        for t in top_ids:
            assert abs(entry[t].logprob - ref[step, t].item()) < 1e-4
    assert target.outputs[0].cumulative_logprob == pytest.approx(
        sum(ref[s, t].item() for s, t in enumerate(alone.token_ids)), abs=1e-3
    )


def test_n_samples_share_the_prompt_blocks_and_are_reproducible(
    model_dir: tuple[torch.nn.Module, str],
) -> None:
    _, path = model_dir
    llm = make_llm(path, block_size=4)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    out = llm.generate([ids(TARGET_PROMPT)], params, use_tqdm=False)[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 4 and all(len(s) == 10 for s in samples)
    # Children 1..3 reuse the 7 full prompt blocks child 0 computes (same step).
    assert llm.engine.stats().prefix_cache_hits >= 3 * 28
    assert out.num_cached_tokens >= 28
    assert_all_free(llm)

    again = llm.generate([ids(TARGET_PROMPT)], params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    # Sample i is the request with seed + i.
    single = llm.generate([ids(TARGET_PROMPT)], SamplingParams(
        temperature=1.0, seed=5, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert tuple(single.outputs[0].token_ids) == samples[2]


def test_n_samples_of_the_largest_seed_wrap_around_the_seed_range(
    model_dir: tuple[torch.nn.Module, str],
) -> None:
    # Sample i draws with seed + i, wrapped inside the signed 64-bit range: the
    # largest seed's sample 1 is the smallest seed's request.
    _, path = model_dir
    llm = make_llm(path)
    params = SamplingParams(n=2, temperature=1.0, seed=MAX_SEED, max_tokens=6, ignore_eos=True)
    out = llm.generate([ids(TARGET_PROMPT)], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [6, 6]
    single = llm.generate([ids(TARGET_PROMPT)], SamplingParams(
        temperature=1.0, seed=MIN_SEED, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == out.outputs[1].token_ids
    assert_all_free(llm)


def test_n_samples_stream_as_deltas_and_abort_together(
    model_dir: tuple[torch.nn.Module, str],
) -> None:
    _, path = model_dir
    llm = make_llm(path, block_size=4)
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("p", ids(TARGET_PROMPT), params)
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            assert out.request_id == "p"
            for c in out.outputs:
                streamed[c.index].extend(c.token_ids)
            if out.finished:
                finals.append(out)
    assert len(finals) == 1
    final = llm.generate([ids(TARGET_PROMPT)], SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [streamed[i] for i in range(3)] == [c.token_ids for c in final.outputs]

    engine.add_request("q", ids(TARGET_PROMPT), SamplingParams(
        n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    aborted = engine.abort_request(["q"])
    assert len(aborted) == 1 and aborted[0].finished
    assert [c.finish_reason for c in aborted[0].outputs] == ["abort"] * 3
    assert_all_free(llm)


def test_prompt_logprobs_match_transformers_under_chunking_and_preemption(
    model_dir: tuple[torch.nn.Module, str],
) -> None:
    model, path = model_dir
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, VOCAB_SIZE, size=40).tolist()
    others, other_params = crowd(rng, 12)
    llm = make_llm(path, max_num_batched_tokens=8, num_kv_blocks=24, block_size=4)
    # Warm the prefix cache with the same prompt: a prompt_logprobs request must not use it.
    llm.generate([ids(prompt)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    outs = llm.generate(
        [ids(p) for p in [*others, prompt]],
        [*other_params, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3,
                                       ignore_eos=True)],
        use_tqdm=False,
    )
    assert llm.last_generate_stats.num_preemptions > 0
    got = outs[-1].prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = hf_logprobs(model, prompt)
    for p in range(1, len(prompt)):
        entry = got[p]
        assert entry is not None
        tok = prompt[p]
        assert abs(entry[tok].logprob - ref[p - 1, tok].item()) < 1e-4, f"position {p}"
        assert entry[tok].rank == int((ref[p - 1] >= ref[p - 1, tok]).sum())
        top = ref[p - 1].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(entry[t].logprob - v) < 1e-4
    assert outs[-1].outputs[0].logprobs is None  # not asked for
    assert_all_free(llm)


def test_min_tokens_holds_back_eos_and_stop_tokens(model_dir: tuple[torch.nn.Module, str]) -> None:
    _, path = model_dir
    llm = make_llm(path)
    assert EOS in llm.engine.eos_token_ids
    # EOS is pushed to the top, yet only sampled once 5 tokens are out.
    eos_first, stop_first, plain = llm.generate(
        [ids(TARGET_PROMPT)] * 3,
        [
            SamplingParams(temperature=0, min_tokens=5, max_tokens=20, logit_bias={EOS: 100}),
            SamplingParams(temperature=0.8, seed=1, min_tokens=3, max_tokens=20,
                           stop_token_ids=[7], logit_bias={7: 100}),
            SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100}),
        ],
        use_tqdm=False,
    )
    c = eos_first.outputs[0]
    assert len(c.token_ids) == 6 and c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    c = stop_first.outputs[0]
    assert len(c.token_ids) == 4 and c.token_ids[-1] == 7 and 7 not in c.token_ids[:-1]
    assert (c.finish_reason, c.stop_reason) == ("stop", 7)
    assert plain.outputs[0].token_ids == [EOS]


def test_allowed_token_ids_and_engine_side_validation(
    model_dir: tuple[torch.nn.Module, str],
) -> None:
    _, path = model_dir
    llm = make_llm(path)
    allowed = [10, 20, 30]
    out = llm.generate([ids(TARGET_PROMPT)], SamplingParams(
        temperature=1.0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
        use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)
    for field, value in [("allowed_token_ids", [VOCAB_SIZE]), ("stop_token_ids", [VOCAB_SIZE + 5]),
                         ("logit_bias", {VOCAB_SIZE: 1.0})]:
        with pytest.raises(ValueError, match=field):
            llm.generate([ids([5, 6])], SamplingParams(**{field: value}), use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([ids([5, 6])], SamplingParams(stop=["x"]), use_tqdm=False)
    assert_all_free(llm)
