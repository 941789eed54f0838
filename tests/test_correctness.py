"""Greedy tokens and logprobs equal transformers' under every batching situation.

For each architecture: 32 prompts of varied lengths (half sharing a 24-token
prefix) run together through our engine in fp32 on the CPU, and each result is
compared with transformers' own `generate` on that prompt alone. The same
comparison runs again with a tiny token budget (chunked prefill mixed with
decodes), a KV pool so small that requests are preempted, prefix-cache hits,
one sequence at a time, and static batching. The KV cache's integrity is
checked after every step, and every block is free at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hf_models import (
    ARCHS,
    TEST_DEVICE,
    VOCAB_SIZE,
    build_hf_model,
    hf_greedy,
    save_hf_model,
)
from tokenmill import LLM, SamplingParams

NUM_PROMPTS = 32


def make_prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(1234)
    shared = rng.integers(3, VOCAB_SIZE, size=24).tolist()
    prompts = []
    for i in range(NUM_PROMPTS):
        length = int(rng.integers(1, 60))
        tail = rng.integers(3, VOCAB_SIZE, size=length).tolist()
        prompts.append(shared + tail[: max(1, length // 3)] if i % 2 else tail)
    max_tokens = rng.integers(4, 20, size=NUM_PROMPTS).tolist()
    return prompts, max_tokens


PROMPTS, MAX_TOKENS = make_prompts()


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    arch = request.param
    model = build_hf_model(arch)
    path = save_hf_model(model, Path(tmp_path_factory.mktemp(arch)))
    refs = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    return {"arch": arch, "path": path, "refs": refs}


# A pool of 512 blocks is ample for these prompts (and cheap to check every step).
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {"num_kv_blocks": 512},
    "budget8": {"max_num_batched_tokens": 8, "num_kv_blocks": 512},
    "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 64},
    "prefix": {"block_size": 4, "num_kv_blocks": 1024},
    "one-seq": {"max_num_seqs": 1, "num_kv_blocks": 512},
    "static": {"scheduling_policy": "static", "max_num_seqs": 8, "num_kv_blocks": 512},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(arch_case: dict[str, Any], scenario: str) -> None:
    llm = LLM(
        arch_case["path"],
        dtype="float32",
        device=TEST_DEVICE,
        skip_tokenizer_init=True,
        check_integrity=True,
        **SCENARIOS[scenario],
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in MAX_TOKENS]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(
        zip(outputs, arch_case["refs"], strict=True)
    ):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}"
        assert completion.finish_reason == "length"
        assert completion.logprobs is not None
        ours = [entry[tok].logprob for entry, tok in zip(completion.logprobs, ref_tokens, strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")

    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
    assert not scheduler.requests
    if scenario == "preempt":
        assert scheduler.num_preemptions > 0
    if scenario == "prefix":
        assert scheduler.prefix_cache_hits > 0
        assert sum(o.num_cached_tokens for o in outputs) > 0
