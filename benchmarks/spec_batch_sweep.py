"""Where n-gram speculation stops paying: generated tok/s of the editing
passages (tokenmill/bench/data/passages.jsonl, copy or correct, greedy) run B at
a time offline, with and without speculation, for each B.

    python benchmarks/spec_batch_sweep.py \
        --batches 1,2,4,8,12,16,32 --max-tokens 160

The default model in bfloat16; speculation's own switch is off
(disable_by_batch_size very large), so every B runs with drafts. Prints one
JSON line per B: tok/s of each, the speed-up, the acceptance rate, and whether
every text came out the same.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.bench.editing import COPY, CORRECT, load_passages


def run(llm: LLM, messages: list[Any], max_tokens: int) -> tuple[float, int, list[str]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), [
        o.outputs[0].text for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8,12,16,32")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    args = parser.parse_args()
    spec = {**json.loads(args.spec), "disable_by_batch_size": 1 << 20}
    passages = load_passages()
    conversations = [[{"role": "user", "content": f"{CORRECT if p.get('typos') else COPY}\n\n"
                       f"{p['text']}"}] for p in passages]
    plain = LLM(dtype="bfloat16", quantization="none", max_num_seqs=64)
    fast = LLM(dtype="bfloat16", quantization="none", max_num_seqs=64, speculative_config=spec)
    run(plain, conversations[:2], 16)  # warm-up
    run(fast, conversations[:2], 16)
    for batch in [int(b) for b in args.batches.split(",")]:
        messages = [conversations[i % len(conversations)] for i in range(batch)]
        s0, n0, t0 = run(plain, messages, args.max_tokens)
        before = fast.engine.scheduler.stats().spec_decoding
        assert before is not None
        drafted, accepted = before.num_draft_tokens, before.num_accepted_tokens
        s1, n1, t1 = run(fast, messages, args.max_tokens)
        after = fast.engine.scheduler.stats().spec_decoding
        assert after is not None
        num_drafted = after.num_draft_tokens - drafted
        print(json.dumps({
            "batch": batch, "plain_tok_s": round(n0 / s0, 1), "spec_tok_s": round(n1 / s1, 1),
            "speedup": round((n1 / s1) / (n0 / s0), 3),
            "acceptance": round((after.num_accepted_tokens - accepted) / max(num_drafted, 1), 3),
            "same_text": t0 == t1, "tokens": [n0, n1]}), flush=True)


if __name__ == "__main__":
    main()
