"""Speculative decoding: exact against transformers' greedy, and the pieces.

The engine tests run 32 prompts (half of them repeat a stretch of themselves,
so prompt lookup finds drafts, and the others only what the output repeats)
through tokenmill with speculation, under a budget of 8 tokens a step and a KV
pool small enough to force preemption, the KV cache checked after every step,
and compare every token and logprob with transformers' greedy decoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hf_models import TEST_DEVICE, VOCAB_SIZE, build_hf_model, hf_greedy, save_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer

NUM_PROMPTS = 32


def make_prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(35)
    prompts = []
    for i in range(NUM_PROMPTS):
        length = int(rng.integers(2, 40))
        tokens = rng.integers(3, VOCAB_SIZE, size=length).tolist()
        if i % 2:  # a passage and the start of its copy: prompt lookup's case
            tokens = tokens + tokens[: max(1, length // 2)]
        prompts.append(tokens)
    max_tokens = rng.integers(4, 24, size=NUM_PROMPTS).tolist()
    return prompts, max_tokens


PROMPTS, MAX_TOKENS = make_prompts()
NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = build_hf_model("llama")
    path = save_hf_model(model, Path(tmp_path_factory.mktemp("target")))
    refs = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    return {"path": path, "refs": refs}


SCENARIOS: dict[str, dict[str, Any]] = {
    # The brief's case: 8 tokens a step and a pool so small that requests are preempted.
    "budget8-preempt": {"max_num_batched_tokens": 8, "num_kv_blocks": 20, "block_size": 4},
    # Every block full of accepted tokens becomes a prefix-cache entry.
    "prefix": {"num_kv_blocks": 2048, "block_size": 4},
}


def run_greedy(path: str, spec: dict[str, Any], **kwargs: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
              check_integrity=True, apply_process_settings=False, speculative_config=spec,
              **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, outputs


def assert_matches_oracle(llm: LLM, outputs: list[Any], refs: list[Any]) -> None:
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, refs, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}"
        assert completion.finish_reason == "length"
        ours = [entry[tok].logprob for entry, tok in zip(completion.logprobs, ref_tokens,
                                                        strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
    assert not scheduler.requests


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ngram_greedy_matches_transformers(target: dict[str, Any], scenario: str) -> None:
    llm, outputs = run_greedy(target["path"], NGRAM, **SCENARIOS[scenario])
    assert_matches_oracle(llm, outputs, target["refs"])
    stats = llm.engine.scheduler.stats().spec_decoding
    assert stats is not None
    # Drafts were verified, some accepted and some rejected (both paths ran).
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    if scenario == "budget8-preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        # Each prompt + its output again: every full block of computed tokens (all
        # but the last output token) is a hit, accepted drafts' blocks included.
        again = [{"prompt_token_ids": p + o.outputs[0].token_ids}
                 for p, o in zip(PROMPTS, outputs, strict=True)]
        hits = llm.generate(again, SamplingParams(max_tokens=1), use_tqdm=False)
        for prompt, out in zip(again, hits, strict=True):
            assert out.num_cached_tokens == (len(prompt["prompt_token_ids"]) - 1) // 4 * 4


# ---- the n-gram proposer --------------------------------------------------------------


def test_ngram_proposes_what_followed_the_earliest_longest_match() -> None:
    proposer = NgramProposer(1, 3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7]
    # The 3-gram 5 6 7 occurs at 0: what followed it there.
    assert proposer.propose(tokens, 3) == [8, 9, 6]
    assert proposer.propose(tokens, 1) == [8]
    # Only a 1-gram matches (9 at 4): the earliest place.
    assert proposer.propose([9, 1, 2, 3, 9], 2) == [1, 2]
    # Nothing matches, or too short: no drafts.
    assert proposer.propose([1, 2, 3, 4], 2) == []
    assert proposer.propose([1], 2) == []
    # The drafts may run into the suffix itself (a repeating run), but not past the end.
    assert NgramProposer(2, 2).propose([4, 4, 4], 5) == [4]


def test_ngram_min_length_is_respected() -> None:
    assert NgramProposer(2, 3).propose([9, 1, 2, 3, 9], 2) == []


# ---- the config -------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "field"), [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
     "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
])
def test_bad_speculative_config_names_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(options)


def test_speculative_config_defaults_as_vllm() -> None:
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 3})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 3}).method == \
        "draft_model"
