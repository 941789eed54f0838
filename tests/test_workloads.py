"""The benchmark workloads are exactly docs/WORKLOADS.md's (its check sums)."""

from __future__ import annotations

import pytest

from tokenmill.bench.workloads import (
    EMBED_CLS,
    EMBED_SEP,
    EMBED_SPECIALS,
    chat_prefix,
    embed_a,
    throughput_a,
)


@pytest.mark.parametrize(("cap", "generated"), [(32, 3707), (128, 10642), (512, 16717), (1536, 16826)])
def test_throughput_a_check_sums(cap: int, generated: int) -> None:
    workload = throughput_a(cap)
    assert len(workload.prompts) == 128
    assert workload.num_prompt_tokens == 16384
    assert workload.num_output_tokens == generated
    assert min(workload.output_lens) >= 1 and max(workload.output_lens) <= cap
    # The prompts are drawn first, so every CAP sees the same prompts.
    assert workload.prompts == throughput_a(32).prompts


def test_chat_prefix_shares_one_system_prompt() -> None:
    workload = chat_prefix()
    assert len(workload.prompts) == 128
    assert all(p[:512] == workload.prompts[0][:512] for p in workload.prompts)
    assert len({tuple(p[512:]) for p in workload.prompts}) == 128
    assert workload.output_lens == [64] * 128


def test_embed_a_check_sums() -> None:
    inputs = embed_a()
    assert len(inputs) == 256
    assert sum(map(len, inputs)) == 62912
    assert min(map(len, inputs)) >= 16 and max(map(len, inputs)) <= 512
    assert all(p[0] == EMBED_CLS and p[-1] == EMBED_SEP for p in inputs)
    assert all(len(EMBED_SPECIALS) <= t < 30522 for p in inputs for t in p[1:-1])
