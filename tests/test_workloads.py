"""The benchmark workloads are exactly docs/WORKLOADS.md's (its check sums)."""

from __future__ import annotations

import pytest

from tokenmill.bench.workloads import chat_prefix, throughput_a


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
