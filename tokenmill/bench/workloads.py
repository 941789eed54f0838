"""Benchmark workloads, exactly as docs/WORKLOADS.md defines them (numpy default_rng)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]  # token ids
    output_lens: list[int]  # tokens to generate per request, EOS ignored

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def throughput_a(cap: int, num_requests: int = 128, prompt_len: int = 128) -> Workload:
    """After the Anyscale study: 128 prompts of 128 random token ids, output
    lengths ~ Exponential(mean 128), rounded up, clipped to [1, cap]."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, 49000, size=(num_requests, prompt_len))
    lens = np.clip(np.ceil(rng.exponential(128.0, size=num_requests)).astype(int), 1, cap)
    return Workload(f"throughput-A/cap{cap}", prompts.tolist(), lens.tolist())


def chat_prefix(num_requests: int = 128, system_len: int = 512, unique_len: int = 32,
                output_len: int = 64) -> Workload:
    """Requests sharing one long system prompt, each with a unique tail."""
    rng = np.random.default_rng(3)
    system = rng.integers(100, 49000, size=system_len).tolist()
    tails = rng.integers(100, 49000, size=(num_requests, unique_len)).tolist()
    return Workload("chat-prefix", [system + t for t in tails], [output_len] * num_requests)
