"""The disk tier's restart-reuse workload (docs/WORKLOADS.md, kv-restart): time to
first token of a long prompt computed cold, loaded from kv_offload_dir after
its blocks were evicted, and loaded again by a new engine on the directory.

PYTHONPATH=. .venv/bin/python benchmarks/kv_offload_ttft.py MODEL TOKENS [DIR]

MODEL: a model directory or GGUF file (bf16); TOKENS: the prompt's length. The
KV pool holds one such prompt and a bit (so the second prompt evicts the
first); prints one JSON line.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

from tokenmill import LLM, SamplingParams

BLOCK = 16


def ttft(llm: LLM, prompt: list[int]) -> float:
    """generate() with max_tokens 1: the prefill and one token, as a client's TTFT."""
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0),
                 use_tqdm=False)
    return time.perf_counter() - start


def offload(llm: LLM) -> dict[str, Any]:
    stats = llm.engine.stats().kv_offload
    assert stats is not None
    t = stats.transfers
    return {"hit_tokens": stats.hits, "query_tokens": stats.queries, "loaded_blocks": t.num_loaded_blocks,
            "stored_blocks": t.num_stored_blocks, "load_s": round(t.load_s, 3), "store_s": round(t.store_s, 3),
            "bytes_loaded": t.bytes_loaded, "bytes_stored": t.bytes_stored}


def main() -> None:
    model, tokens = sys.argv[1], int(sys.argv[2])
    directory = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp(prefix="kv-restart-")
    rng = np.random.default_rng(54)
    a, b = rng.integers(100, 49000, size=(2, tokens)).tolist()
    num_blocks = -(-(tokens + 64) // BLOCK) + 32
    options = {"dtype": "bfloat16", "block_size": BLOCK, "num_kv_blocks": num_blocks, "max_num_seqs": 1,
               "max_model_len": num_blocks * BLOCK, "skip_tokenizer_init": True, "kv_offload_dir": directory,
               "kv_offload_bytes": 64 << 30}
    out: dict[str, Any] = {"model": model, "prompt_tokens": tokens, "num_kv_blocks": num_blocks}
    llm = LLM(model, **options)
    out["cold_s"] = ttft(llm, a)
    out["cold_b_s"] = ttft(llm, b)  # (evicts a's blocks from RAM; both were written as computed)
    out["after_cold"] = offload(llm)
    out["disk_s"] = ttft(llm, a)  # a's blocks from files
    out["after_disk"] = offload(llm)
    del llm
    restarted = LLM(model, **options)
    out["restart_s"] = ttft(restarted, a)
    out["after_restart"] = offload(restarted)
    out["disk_vs_cold"] = round(out["disk_s"] / out["cold_s"], 4)
    out["restart_vs_cold"] = round(out["restart_s"] / out["cold_s"], 4)
    print(json.dumps(out))
    if len(sys.argv) <= 3:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
