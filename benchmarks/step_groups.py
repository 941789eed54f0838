"""Forward time of each step of throughput-A, grouped by path and shape: PYTHONPATH=TREE .venv/bin/python benchmarks/step_groups.py [CAP] [--dequantize].

Two trees run back to back (`cd TREE && PYTHONPATH=$PWD python /path/to/step_groups.py`)
show where a forward got slower or faster, step kind by step kind: a whole
`bench throughput` run moved 2x between minutes on a VM with steal time, while
these sums moved by about 2% (docs/perf-notes.md, issue 48's check).
--dequantize passes quantization="none" (trees where a quantized GGUF runs its
blocks by default need it for the bf16 forward; older trees refuse it).
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workloads import throughput_a


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cap = int(args[0]) if args else 128
    extra: dict[str, Any] = {"quantization": "none"} if "--dequantize" in sys.argv else {}
    workload = throughput_a(cap)
    llm = LLM(dtype="bfloat16", max_num_seqs=128, max_num_batched_tokens=2048,
              enable_prefix_caching=False, **extra)
    forward = llm.engine.runner.forward
    steps: list[tuple[float, int, bool, bool, str]] = []
    call = type(forward).__call__

    def timed(self: Any, input_ids: Any, positions: Any, kv_caches: Any, meta: Any,
              output_rows: Any = None) -> Any:
        t = time.perf_counter()
        out = call(self, input_ids, positions, kv_caches, meta, output_rows)
        steps.append((time.perf_counter() - t, input_ids.shape[0], meta.num_decodes == meta.num_reqs,
                      output_rows is None, str(getattr(self, "last_path", "-"))))
        return out

    type(forward).__call__ = timed  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps.clear()
    llm.generate(prompts, params, use_tqdm=False)
    groups: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    for seconds, rows, decode_only, _, path in steps:
        kind = "decode" if decode_only else "mixed"
        groups[(kind, path, rows // 32 * 32 if decode_only else rows // 512 * 512)].append(seconds)
    print("| step kind | path | rows from | steps | sum s | mean ms |")
    print("|---|---|---|---|---|---|")
    for (kind, path, rows), times in sorted(groups.items()):
        print(f"| {kind} | {path} | {rows} | {len(times)} | {sum(times):.2f} | {1e3 * sum(times) / len(times):.1f} |")
    print(f"forward total {sum(s[0] for s in steps):.2f} s over {len(steps)} steps")


if __name__ == "__main__":
    main()
