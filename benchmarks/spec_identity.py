"""Greedy token ids with and without speculative decoding, passage by passage
(the editing passages, copy or correct, through the chat template, one at a
time), offline: which passages differ and at which token. Greedy output must
not change with speculation, in bfloat16 too (docs/perf-notes.md).

    python benchmarks/spec_identity.py --num-passages 16 --max-tokens 200
    python benchmarks/spec_identity.py --no-cpp-kernels   # the reference torch path

Exits 1 where any passage differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.editing import DEFAULT_SPEC, chat_body, load_passages


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-passages", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--no-cpp-kernels", action="store_true")
    args = parser.parse_args()
    if args.no_cpp_kernels:  # (read when the engine builds its runner: backends/cpu/options.py)
        os.environ["TOKENMILL_NO_CPP_KERNELS"] = "1"
    passages = load_passages()[: args.num_passages]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    runs: list[list[list[int]]] = []
    for spec in (None, json.loads(args.spec)):
        llm = LLM(dtype=args.dtype, quantization="none", speculative_config=spec)
        start = time.perf_counter()
        runs.append([list(llm.chat(chat_body("m", p, args.max_tokens)["messages"], params,
                                   use_tqdm=False)[0].outputs[0].token_ids) for p in passages])
        tokens = sum(map(len, runs[-1]))
        print(f"{'speculative' if spec else 'plain'}: {tokens} tokens, "
              f"{tokens / (time.perf_counter() - start):.1f} tok/s", flush=True)
        del llm
    num_differ = 0
    for p, a, b in zip(passages, *runs, strict=True):
        if a == b:
            print(f"{p['id']}: same ({len(a)} tokens)")
            continue
        num_differ += 1
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        print(f"{p['id']}: DIFFERS from token {at} ({len(a)} plain, {len(b)} speculative tokens)")
    print(f"{len(passages) - num_differ}/{len(passages)} the same")
    return 1 if num_differ else 0


if __name__ == "__main__":
    sys.exit(main())
