"""throughput-A and embed-A on vLLM: run by the vLLM venv's python, never by tokenmill's.

    python vllm_runner.py SPEC.json RESULT.json

SPEC: {"model": HF dir, "dtype", "max_num_seqs", "max_num_batched_tokens" (null:
vLLM's default), "num_gpu_blocks_override" and "block_size" (optional: the KV pool
in blocks of that many tokens; absent, vLLM sizes it from VLLM_CPU_KVCACHE_SPACE),
"prompts": [[token ids]], "output_lens": [ints]}. RESULT: one JSON object: wall_s,
generated_tokens, peak memory and the settings vLLM ran with.

SPEC with "task": "embed" (embed-A): "model", "dtype", "max_num_seqs",
"max_num_batched_tokens", "prompts", "warmup" (inputs embedded before the
timing), "num_probes"; RESULT: wall_s, num_outputs, the first num_probes
embeddings ("probes"), peak_rss_mib and "settings".

SPEC with "task": "lora" (lora-A, bench/lora.py): "model", "dtype",
"max_num_seqs", "lora_paths" (PEFT directories), "max_lora_rank", "prompts",
"output_lens", "one_stream" ([prompt, tokens]), "one_stream_pairs" (one-stream
base/adapter pairs a repeat), "repeats"; RESULT: "rows" (name,
wall_s, generated_tokens), alternating base and adapter runs as tokenmill's.

This file imports only vllm and the standard library (a test checks it): the
vLLM venv has no tokenmill. The main guard matters, as vLLM spawns processes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

RSS_INTERVAL_S = 0.25
RSS_HOW = ("peak over the runner and all its descendants (vLLM's engine core and worker are "
           f"child processes), sampled every {RSS_INTERVAL_S} s: the row's number is the sum of "
           "PSS (shared pages split between the processes that map them, so a library loaded "
           "by three processes counts once); peak_rss_sum_mib sums plain RSS")


def process_tree(root: int) -> set[int]:
    """`root` and every process below it, from /proc."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # The command name is in parentheses and may hold spaces: split after it.
        parents[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    return tree


def memory_bytes(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in bytes; (0, 0) once it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    return rss, pss


class PeakMemory:
    """Samples the process tree below this process in a thread; keeps the peaks of
    the summed RSS and the summed PSS."""

    def __init__(self) -> None:
        self.peak_rss_bytes = 0
        self.peak_pss_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(RSS_INTERVAL_S):
                return

    def sample(self) -> None:
        sizes = [memory_bytes(pid) for pid in process_tree(os.getpid())]
        self.peak_rss_bytes = max(self.peak_rss_bytes, sum(s[0] for s in sizes))
        self.peak_pss_bytes = max(self.peak_pss_bytes, sum(s[1] for s in sizes))

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _engine_setting(llm: Any, name: str, fallback: Any, config: str = "scheduler_config") -> Any:
    """A setting as vLLM resolved it (defaults filled in), where visible."""
    try:
        return getattr(getattr(llm.llm_engine.vllm_config, config), name)
    except AttributeError:
        return fallback


def _num_preemptions(llm: Any) -> int | None:
    try:
        for metric in llm.get_metrics():
            if metric.name == "vllm:num_preemptions":
                return int(metric.value)
    except Exception:  # metrics are optional: an older or newer API answers None
        return None
    return None


def run_embed(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    with PeakMemory() as memory:
        llm = LLM(model=spec["model"], dtype=spec["dtype"], runner="pooling",
                  max_num_seqs=spec["max_num_seqs"],
                  max_num_batched_tokens=spec["max_num_batched_tokens"], disable_log_stats=False)
        llm.embed([{"prompt_token_ids": p} for p in spec["warmup"]], use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.embed([{"prompt_token_ids": p} for p in spec["prompts"]], use_tqdm=False)
        wall = time.perf_counter() - start
    return {
        "wall_s": wall, "num_outputs": len(outputs),
        "probes": [list(o.outputs.embedding) for o in outputs[:spec["num_probes"]]],
        "peak_rss_mib": memory.peak_pss_bytes / 2**20,
        "settings": {
            "rss": RSS_HOW, "peak_rss_sum_mib": memory.peak_rss_bytes / 2**20,
            "max_num_seqs": _engine_setting(llm, "max_num_seqs", spec["max_num_seqs"]),
            "max_num_batched_tokens": _engine_setting(llm, "max_num_batched_tokens",
                                                      spec["max_num_batched_tokens"]),
            "vllm_version": getattr(sys.modules["vllm"], "__version__", "unknown"),
        },
    }


def run_lora(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    paths: list[str] = spec["lora_paths"]
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              enable_prefix_caching=False, enable_lora=True, max_loras=len(paths),
              max_lora_rank=spec["max_lora_rank"], max_cpu_loras=len(paths))
    loras = [LoRARequest(f"a{k}", k + 1, path) for k, path in enumerate(paths)]
    llm.generate([{"prompt_token_ids": [7] * 16}] * len(loras), SamplingParams(max_tokens=4),
                 lora_request=loras, use_tqdm=False)  # (loaded before the timing)
    prompts, lens = spec["prompts"], spec["output_lens"]
    one_prompt, one_len = spec["one_stream"]
    rows = []

    def timed(name: str, batch: list[list[int]], batch_lens: list[int], per_request: list[Any]) -> None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in batch_lens]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, lora_request=per_request,
                               use_tqdm=False)
        wall = time.perf_counter() - start
        rows.append({"name": name, "wall_s": wall,
                     "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})

    for _ in range(spec["repeats"]):
        timed("base requests", prompts, lens, [None] * len(prompts))
        timed("adapters", prompts, lens, [loras[i % len(loras)] for i in range(len(prompts))])
        for _ in range(spec.get("one_stream_pairs", 1)):
            timed("one stream, base", [one_prompt], [one_len], [None])
            timed("one stream, adapter 0", [one_prompt], [one_len], [loras[0]])
    return {"rows": rows, "vllm_version": getattr(sys.modules["vllm"], "__version__", "unknown")}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    prompts: list[list[int]] = spec["prompts"]
    output_lens: list[int] = spec["output_lens"]
    kwargs: dict[str, Any] = {
        "model": spec["model"], "dtype": spec["dtype"], "max_num_seqs": spec["max_num_seqs"],
        "enable_prefix_caching": False, "disable_log_stats": False,
    }
    if spec.get("max_num_batched_tokens") is not None:
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    # The pool's size in blocks: vLLM's engine core applies this override on every
    # platform, after its own sizing (VLLM_CPU_KVCACHE_SPACE is whole GiB only).
    for name in ("num_gpu_blocks_override", "block_size"):
        if spec.get(name) is not None:
            kwargs[name] = spec[name]
    if spec.get("num_gpu_blocks_override") is not None and spec.get("block_size") is not None:
        # vLLM refuses a max_model_len its pool cannot hold with a block to spare
        # (8192 tokens of 512 x 16 against the default model's 8192); tokenmill
        # caps its own at the pool the same way.
        kwargs["max_model_len"] = (spec["num_gpu_blocks_override"] - 1) * spec["block_size"]
    with PeakMemory() as memory:
        llm = LLM(**kwargs)
        # Warm-up as tokenmill's runs do: 4 short requests sharing nothing with the workload.
        warmup = [[(i * 131 + j) % 90 + 1 for j in range(128)] for i in range(4)]
        llm.generate([{"prompt_token_ids": p} for p in warmup],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        preempted_before = _num_preemptions(llm)
        requests = [{"prompt_token_ids": p} for p in prompts]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in output_lens]
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        wall = time.perf_counter() - start
        preempted_after = _num_preemptions(llm)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    short = [i for i, (o, n) in enumerate(zip(outputs, output_lens, strict=True))
             if len(o.outputs[0].token_ids) != n]
    if short:
        raise SystemExit(f"vLLM returned the wrong number of tokens for {len(short)} "
                         f"requests (first: request {short[0]})")
    preemptions = (None if preempted_before is None or preempted_after is None
                   else preempted_after - preempted_before)
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "peak_rss_mib": memory.peak_pss_bytes / 2**20,
        "peak_rss_sum_mib": memory.peak_rss_bytes / 2**20,
        "rss": RSS_HOW,
        "num_preemptions": preemptions,
        "max_num_seqs": _engine_setting(llm, "max_num_seqs", spec["max_num_seqs"]),
        "max_num_batched_tokens": _engine_setting(llm, "max_num_batched_tokens",
                                                  spec.get("max_num_batched_tokens")),
        "enable_prefix_caching": False,
        "num_kv_blocks": _engine_setting(llm, "num_gpu_blocks",
                                         spec.get("num_gpu_blocks_override"), "cache_config"),
        "block_size": _engine_setting(llm, "block_size", spec.get("block_size"), "cache_config"),
        "vllm_version": getattr(sys.modules["vllm"], "__version__", "unknown"),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    task = spec.get("task")
    result = run_embed(spec) if task == "embed" else run_lora(spec) if task == "lora" else run(spec)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
