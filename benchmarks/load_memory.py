"""Load time and memory of `LLM(model)` in a fresh process (issue 49):

    PYTHONPATH=. python benchmarks/load_memory.py MODEL [QUANTIZATION] [KV_GIB]

Prints the import and `LLM(...)` seconds and, from /proc/self/status once it
returns, VmRSS (RSS after load), RssAnon, RssFile (mapped files: libraries, a
GGUF's pages while its map is open) and VmHWM (the peak RSS of the load).
QUANTIZATION as `--quantization` (default gguf), KV_GIB the KV cache (default 2).
"""

from __future__ import annotations

import sys
import time

t0 = time.perf_counter()
from tokenmill import LLM  # noqa: E402

model = sys.argv[1]
quantization = sys.argv[2] if len(sys.argv) > 2 else "gguf"
kv_gib = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
t1 = time.perf_counter()
llm = LLM(model, quantization=quantization, kv_cache_memory_bytes=int(kv_gib * (1 << 30)), max_model_len=4096)
t2 = time.perf_counter()
mib = {}
with open("/proc/self/status") as status:
    for line in status:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            mib[key] = int(value.split()[0]) // 1024
print(f"import {t1 - t0:.1f} s, LLM() {t2 - t1:.1f} s; MiB: " + ", ".join(f"{k} {v}" for k, v in mib.items()))
