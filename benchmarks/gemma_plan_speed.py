"""Gemma 3 270M Q4_K_M at one stream: the CPU plan against the reference forward.

    PYTHONPATH=. python benchmarks/gemma_plan_speed.py [--tokens 128] [--reference-tokens 32]

One prompt, greedy, `ignore_eos`, quantization="gguf" (the file's own blocks),
the dtype the machine picks (bf16 with AVX512-BF16). Each path: one short
warm-up generate, then the timed ones (no prefix caching: each prompt computed
anew); prints the time to the first token and the decode's ms a token (the rest
of the run over the rest of the tokens).

The reference path is what served Gemma before the plan did: the reference
forward (its GGUF blocks dequantized at each call) with the C++ paged
attention, chosen by making the runner's `unsupported` give a reason. It is slow, so it
decodes fewer tokens (`--reference-tokens`).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

from tokenmill import LLM, SamplingParams
from tokenmill.model.source import gemma3_270m_path
from tokenmill.worker import model_runner

PROMPT = "Once upon a time, in a small village by the sea,"


def run(path: str, tokens: int, reference: bool) -> tuple[str, float, float]:
    refuse = mock.patch.object(model_runner, "unsupported", lambda *a, **k: "measuring the reference")
    with refuse if reference else contextlib.nullcontext():
        llm = LLM(path, quantization="gguf", max_model_len=512, kv_cache_memory_bytes=64 << 20,
                  enable_prefix_caching=False)
    forward = type(llm.engine.runner.forward).__name__
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    first = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    ttft = time.perf_counter() - start
    assert first[0].outputs[0].token_ids
    start = time.perf_counter()
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                       use_tqdm=False)
    total = time.perf_counter() - start
    assert len(out[0].outputs[0].token_ids) == tokens
    return forward, ttft * 1e3, (total - ttft) / (tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reference-tokens", type=int, default=32)
    args = parser.parse_args()
    path = gemma3_270m_path()
    for name, tokens, reference in (("plan", args.tokens, False), ("reference", args.reference_tokens, True)):
        forward, ttft_ms, tpot_ms = run(path, tokens, reference)
        print(f"{name:9s} ({forward}): {tokens} tokens, first token {ttft_ms:.1f} ms, "
              f"then {tpot_ms:.1f} ms a token ({1e3 / tpot_ms:.1f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
