"""Decode at depth, as `llama-bench -d D -n 128 -p 0` measures it: a prompt of D
random tokens (its prefill timed apart, as TTFT), then 128 tokens generated
one stream, greedy, EOS ignored; tg = 127 / (the time from the first token to
the last). The engine's defaults otherwise (KV in the model's dtype unless
--kv-cache-dtype says, batch invariance on).

    .venv/bin/python benchmarks/depth_decode.py MODEL [DEPTH ...] [--kv-cache-dtype q8_0]
    (depths default 4096 16384; llama.cpp's peer: llama-bench -d D -n 128 -p 0 -ctk q8_0 -ctv q8_0)

Prints a JSON line per depth: depth, kv_cache_dtype, ttft_s, tg_tok_s.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from tokenmill import LLM, SamplingParams

GENERATED = 128


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("depths", nargs="*", type=int, default=[4096, 16384])
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    model, depths = args.model, args.depths
    llm = LLM(model, max_model_len=max(depths) + GENERATED + 16, skip_tokenizer_init=True,
              enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype)
    rng = np.random.default_rng(54)
    for depth in depths:
        prompt = rng.integers(100, 49000, size=depth).tolist()
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        tg = (GENERATED - 1) / (m.last_token_time - m.first_token_time)
        print(json.dumps({"model": model, "depth": depth, "kv_cache_dtype": args.kv_cache_dtype, "ttft_s": round(m.first_token_time - m.arrival_time, 2),
                          "tg_tok_s": round(tg, 2)}), flush=True)


if __name__ == "__main__":
    main()
