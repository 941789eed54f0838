"""The KV a sliding-window model holds at a long context, with windows that give
their blocks back (the default) and with one block table for every layer
(--disable-hybrid-kv-cache-manager): the real Gemma 3 270M Q4_K_M file (one
global layer in six, the others a 512-token window), one request of TOKENS
prompt tokens and 16 generated.

    .venv/bin/python benchmarks/window_memory.py [TOKENS]

Prints, for each mode, the KV held at its peak (a prefill chunk's blocks
included) and while decoding, in MiB and as a share of all-global layers'
(every layer's K/V for every token), the time to the first token, and whether
both modes gave the same tokens.
"""

from __future__ import annotations

import sys
import time

from tokenmill import LLM, SamplingParams, gemma3_270m_path


def run(tokens: int, disable: bool) -> dict[str, object]:
    llm = LLM(gemma3_270m_path(), max_model_len=tokens + 16, kv_cache_memory_bytes=1 << 30,
              enable_prefix_caching=False, skip_tokenizer_init=True, disable_hybrid_kv_cache_manager=disable)
    engine = llm.engine
    kv, runner = engine.scheduler.kv, engine.runner
    block_bytes = runner.kv_cache_bytes() / kv.num_blocks
    prompt = [(i * 7919) % 200_000 + 100 for i in range(tokens)]
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    start, ttft, peak, decoding, out = time.perf_counter(), 0.0, 0, 0, []
    while engine.has_unfinished_requests():
        result = engine.step()
        held = kv.num_blocks - kv.pool.num_free_blocks
        peak = max(peak, held)
        for o in result.outputs:
            out = list(o.outputs[0].token_ids)  # type: ignore[union-attr]
            if not ttft and out:
                ttft = time.perf_counter() - start
            elif out:
                decoding = max(decoding, held)
    spec = engine.spec
    all_global = (tokens + 16) * spec.kv_bytes_per_token * 2  # bf16
    return {"peak_mib": peak * block_bytes / 2**20, "decode_mib": decoding * block_bytes / 2**20,
            "all_global_mib": all_global / 2**20, "ttft_s": ttft, "tokens": out,
            "layout": f"{len(runner.layout.groups)} groups of {runner.layout.slots} layers"}


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32_000
    rows = {name: run(tokens, disable) for name, disable in (("windows freed", False), ("one table", True))}
    for name, r in rows.items():
        print(f"{name:14s} {r['layout']}: peak {r['peak_mib']:.0f} MiB ({r['peak_mib'] / r['all_global_mib']:.2f} "
              f"of all-global), decoding {r['decode_mib']:.0f} MiB ({r['decode_mib'] / r['all_global_mib']:.2f}), "
              f"TTFT {r['ttft_s']:.1f} s")
    same = rows["windows freed"]["tokens"] == rows["one table"]["tokens"]
    print(f"{tokens} prompt tokens; all-global K/V {rows['one table']['all_global_mib']:.0f} MiB; "
          f"same tokens: {same}")


if __name__ == "__main__":
    main()
