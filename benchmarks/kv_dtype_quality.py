"""What an 8-bit KV cache costs in quality, against KV in the model's dtype
(issue 54; docs/perf-notes.md "8-bit KV"): on the default model in bfloat16
(the GGUF dequantized), for each --kv-cache-dtype:

- perplexity over the bench passages (tokenmill/bench/data/passages.jsonl,
  each passage one prompt, prompt logprobs of every token after the first);
- the logprobs of the same token sequences (each passage's first 256 tokens,
  teacher-forced): the largest and the mean absolute difference from "auto";
- greedy text: 32 prompts (the passages' first sentences as instructions), 64
  tokens each, how many are equal to "auto"'s, and the mean common prefix.

    .venv/bin/python benchmarks/kv_dtype_quality.py [--formats auto,q8_0,fp8_e4m3,fp8_e5m2]

Prints a JSON line per format.
"""

from __future__ import annotations

import argparse
import json
import math

from tokenmill import LLM, SamplingParams
from tokenmill.bench.editing import load_passages

GREEDY_PROMPTS, GREEDY_TOKENS, TEACHER_TOKENS = 32, 64, 256
KV_BYTES = 256 << 20


def prompt_logprobs(llm: LLM, token_lists: list[list[int]]) -> list[list[float]]:
    """Each prompt's logprob of every token after the first."""
    outs = llm.generate([{"prompt_token_ids": t} for t in token_lists],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    result = []
    for tokens, out in zip(token_lists, outs, strict=True):
        assert out.prompt_logprobs is not None
        result.append([entry[tok].logprob for tok, entry in zip(tokens[1:], out.prompt_logprobs[1:], strict=True)
                       if entry is not None])
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default="auto,q8_0,fp8_e4m3,fp8_e5m2")
    p.add_argument("--model", default=None)
    args = p.parse_args()
    passages = load_passages()
    base: dict[str, object] = {}
    for name in args.formats.split(","):
        # One memory budget for every format: the pool's block count shows the bytes per token.
        llm = LLM(args.model, dtype="bfloat16", quantization="none", kv_cache_dtype=name,
                  enable_prefix_caching=False, kv_cache_memory_bytes=KV_BYTES)
        tok = llm.get_tokenizer()
        texts = [x["text"] for x in passages]
        whole = [tok.encode(t) for t in texts]
        lps = prompt_logprobs(llm, whole)
        nll = -sum(sum(x) for x in lps) / sum(len(x) for x in lps)
        teacher = prompt_logprobs(llm, [t[:TEACHER_TOKENS] for t in whole])
        instructions = [f"Continue this text: {t.split('. ')[0]}." for t in texts]
        chats = [[{"role": "user", "content": s}] for s in (instructions * 2)[:GREEDY_PROMPTS]]
        outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS), use_tqdm=False)
        greedy = [list(o.outputs[0].token_ids) for o in outs]
        row: dict[str, object] = {"kv_cache_dtype": name, "cache_dtype": llm.engine.facts.cache.cache_dtype,
                                  "num_kv_blocks": llm.engine.runner.num_blocks,
                                  "kv_cache_bytes": llm.engine.runner.kv_cache_bytes(),
                                  "perplexity": round(math.exp(nll), 4), "tokens_scored": sum(len(x) for x in lps)}
        if name == "auto":
            base = {"nll": nll, "teacher": teacher, "greedy": greedy}
        else:
            diffs = [abs(a - b) for xs, ys in zip(teacher, base["teacher"], strict=True)  # type: ignore[call-overload]
                     for a, b in zip(xs, ys, strict=True)]
            ref = base["greedy"]
            prefixes = []
            for a, b in zip(greedy, ref, strict=True):  # type: ignore[call-overload]
                n = 0
                while n < min(len(a), len(b)) and a[n] == b[n]:
                    n += 1
                prefixes.append(n)
            row.update({
                "perplexity_vs_auto": round(math.exp(nll - base["nll"]), 5),  # type: ignore[operator]
                "logprob_max_abs_diff": round(max(diffs), 4), "logprob_mean_abs_diff": round(sum(diffs) / len(diffs), 5),
                "greedy_equal": sum(a == b for a, b in zip(greedy, ref, strict=True)),  # type: ignore[call-overload]
                "greedy_prompts": len(greedy), "mean_common_prefix": round(sum(prefixes) / len(prefixes), 1),
            })
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
