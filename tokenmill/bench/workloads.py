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


@dataclass(frozen=True)
class Interactive1:
    """interactive-1's prompts: each phase its own throughput-A prompts, so no
    prompt is sent twice (a prefix cache never helps a later phase)."""

    warmup: list[int]
    one: list[list[int]]  # the 1-stream phase, in order
    four: list[list[int]]  # the 4-stream phase, stream s sends four[s::4]
    long: list[list[int]]  # 2,048-token prompts, each sent alone with max_tokens 1
    busy: list[list[int]]  # the 4-stream phase with one core busy, one request a stream


def interactive_1(requests_one: int = 3, requests_four: int = 2, long_len: int = 2048,
                  num_long: int = 2) -> Interactive1:
    """throughput-A's prompts in order: 1 stream, then 4 streams, then the busy
    phase; the warm-up is the last prompt's first 16 tokens. Long prompts from
    default_rng(4).integers(100, 49000, size=(num_long, long_len))."""
    prompts = throughput_a(128).prompts
    a, b = requests_one, requests_one + 4 * requests_four
    if b + 4 >= len(prompts):
        raise ValueError(f"interactive-1 has {len(prompts) - 1} prompts; asked for {b + 4}")
    long = np.random.default_rng(4).integers(100, 49000, size=(num_long, long_len)).tolist()
    return Interactive1(warmup=prompts[-1][:16], one=prompts[:a], four=prompts[a:b],
                        long=long, busy=prompts[b:b + 4])


@dataclass(frozen=True)
class Sizes:
    """The sizes workload's prompts: throughput-A's in order, each sent once."""

    warmup: list[int]
    phases: dict[int, list[list[list[int]]]]  # streams -> each stream's prompts, in order
    long: list[list[int]]  # 512-token prompts, each sent alone with max_tokens 1
    tg_prompt: list[int]  # one token, then 128 generated: llama-bench's tg128 through HTTP


def sizes(streams: tuple[int, ...] = (1, 4, 16), requests_one: int = 2, long_len: int = 512,
          num_long: int = 2) -> Sizes:
    """Phase by phase, in the order given, each takes the next prompts of throughput-A: the
    1-stream phase `requests_one` of them, an S-stream phase one a stream. Warm-up: the last
    prompt's first 16 tokens; tg128's prompt: its first token. Long prompts from
    default_rng(5).integers(100, 49000, size=(num_long, long_len))."""
    prompts = throughput_a(128).prompts
    phases: dict[int, list[list[list[int]]]] = {}
    start = 0
    for s in streams:
        n = requests_one if s == 1 else s
        if start + n >= len(prompts):
            raise ValueError(f"the sizes workload has {len(prompts) - 1} prompts; asked for {start + n}")
        phases[s] = [prompts[start + i:start + n:s] for i in range(s)]
        start += n
    long = np.random.default_rng(5).integers(100, 49000, size=(num_long, long_len)).tolist()
    return Sizes(warmup=prompts[-1][:16], phases=phases, long=long, tg_prompt=prompts[-1][:1])


# embed-A's ids are in the vocabulary bench/embed.py writes for its model: these
# five specials first (BERT's order of them), then words.
EMBED_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
EMBED_CLS, EMBED_SEP = EMBED_SPECIALS.index("[CLS]"), EMBED_SPECIALS.index("[SEP]")


def embed_a(num_inputs: int = 256, min_len: int = 16, max_len: int = 512,
            vocab_size: int = 30522) -> list[list[int]]:
    """Retrieval chunks to embed, all at once: lengths uniform in [min_len, max_len]
    (default_rng(52).integers, drawn first), each [CLS] + random word ids + [SEP]."""
    rng = np.random.default_rng(52)
    lens = rng.integers(min_len, max_len + 1, size=num_inputs)
    first_word = len(EMBED_SPECIALS)
    return [[EMBED_CLS, *rng.integers(first_word, vocab_size, size=int(n) - 2).tolist(), EMBED_SEP]
            for n in lens]
