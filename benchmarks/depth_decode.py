"""Decode at depth, as `llama-bench -d D -n 128 -p 0` measures it: a prompt of D
random tokens (its prefill timed apart, as TTFT), then 128 tokens generated
one stream, greedy, EOS ignored; tg = 127 / (the time from the first token to
the last). The engine's defaults otherwise (bf16 KV, batch invariance on).

    .venv/bin/python benchmarks/depth_decode.py MODEL [DEPTH ...]   (default 4096 16384)

Prints a JSON line per depth: depth, ttft_s, tg_tok_s.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from tokenmill import LLM, SamplingParams

GENERATED = 128


def main() -> None:
    model = sys.argv[1]
    depths = [int(d) for d in sys.argv[2:]] or [4096, 16384]
    llm = LLM(model, max_model_len=max(depths) + GENERATED + 16, skip_tokenizer_init=True,
              enable_prefix_caching=False)
    rng = np.random.default_rng(54)
    for depth in depths:
        prompt = rng.integers(100, 49000, size=depth).tolist()
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        tg = (GENERATED - 1) / (m.last_token_time - m.first_token_time)
        print(json.dumps({"model": model, "depth": depth, "ttft_s": round(m.first_token_time - m.arrival_time, 2),
                          "tg_tok_s": round(tg, 2)}), flush=True)


if __name__ == "__main__":
    main()
