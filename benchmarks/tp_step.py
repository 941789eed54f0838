"""TP=1 against TP=2 (one core per rank) on the default model: engine step times and greedy agreement: PYTHONPATH=. .venv/bin/python benchmarks/tp_step.py [--profile] [--only TP=2] [out.json]."""

# Each configuration builds its own engine (prefix caching off, so every prompt
# is computed), then times: one prefill step of a 512-token prompt, and decode
# steps at B = 1, 8, 32 (128-token prompts, median of 24 steps after 4 warm-up
# ones). Greedy agreement: 6 prompts x 48 tokens, compared with TP=1 (1 thread).
# --profile: where rank 0's decode steps spend their time (the command
# broadcasts, each all-reduce seen from Python, the logits' gather; the rest
# is compute and the Python around it), from timers around RankGroup's methods.
# --only NAME: the configurations whose names start with NAME.

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from tokenmill import SamplingParams
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine

# name, tensor_parallel_size, threads (None: the default), environment for the run
# (TOKENMILL_TP_SHM=0: the all-reduce over gloo; TOKENMILL_TP_LAYER_LOOP=0: a
# shard's layers in the plan's Python loop).
CONFIGS: list[tuple[str, int, int | None, dict[str, str]]] = [
    ("TP=1, 1 thread", 1, 1, {}),
    ("TP=1, 2 threads", 1, 2, {}),
    ("TP=2, gloo all-reduce", 2, None, {"TOKENMILL_TP_SHM": "0"}),
    ("TP=2, shm all-reduce, Python layer loop", 2, None, {"TOKENMILL_TP_LAYER_LOOP": "0"}),
    ("TP=2, shm all-reduce in the C++ layer loop", 2, None, {}),
]
BATCHES = (1, 8, 32)
TEXT = ("The quick brown fox jumps over the lazy dog while the river runs to the sea, and "
        "every morning the baker opens the shop before the sun has risen over the hills. ")


def prompt_ids(engine: LLMEngine, n: int, salt: int) -> list[int]:
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(f"{salt}: " + TEXT * (n // 20 + 2))
    return ids[:n]


class Timers:
    """Seconds and calls spent in RankGroup's methods (rank 0, this process)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def install(self) -> None:
        from tokenmill.distributed.group import RankGroup

        for name in ("send", "all_reduce", "gather_columns"):
            original = getattr(RankGroup, name)

            def timed(*args: Any, _f: Any = original, _name: str = name) -> Any:
                start = time.perf_counter()
                try:
                    return _f(*args)
                finally:
                    self.seconds[_name] = self.seconds.get(_name, 0.0) + time.perf_counter() - start
                    self.calls[_name] = self.calls.get(_name, 0) + 1

            setattr(RankGroup, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


TIMERS: Timers | None = None


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure(engine: LLMEngine) -> dict[str, Any]:
    out: dict[str, Any] = {}
    long = SamplingParams(max_tokens=4096, ignore_eos=True, temperature=0.0)
    engine.add_request("warm", {"prompt_token_ids": prompt_ids(engine, 64, 999)}, long)
    for _ in range(4):
        engine.step()
    engine.abort_request(["warm"])
    engine.add_request("prefill", {"prompt_token_ids": prompt_ids(engine, 512, 0)}, long)
    out["prefill_512_ms"] = timed_step(engine) * 1e3
    engine.abort_request(["prefill"])
    for batch in BATCHES:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, {"prompt_token_ids": prompt_ids(engine, 128, i + 1)}, long)
        while engine.scheduler.stats().num_waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
        for _ in range(4):
            engine.step()
        if TIMERS is not None:
            TIMERS.reset()
        times = [timed_step(engine) for _ in range(24)]
        out[f"decode_B{batch}_ms"] = statistics.median(times) * 1e3
        if TIMERS is not None and TIMERS.calls:
            per_step = {k: round(v / len(times) * 1e3, 3) for k, v in TIMERS.seconds.items()}
            calls = {k: v / len(times) for k, v in TIMERS.calls.items()}
            out[f"decode_B{batch}_profile"] = {"ms_per_step": per_step, "calls_per_step": calls,
                                               "mean_step_ms": round(sum(times) / len(times) * 1e3, 3)}
        engine.abort_request(ids)
    greedy = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)
    for i in range(6):
        engine.add_request(f"g{i}", {"prompt_token_ids": prompt_ids(engine, 40 + 17 * i, 100 + i)}, greedy)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step().outputs:
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    out["greedy"] = [tokens[f"g{i}"] for i in range(6)]
    return out


def main() -> None:
    global TIMERS
    args = sys.argv[1:]
    if "--profile" in args:
        args.remove("--profile")
        TIMERS = Timers()
        TIMERS.install()
    only = ""
    if "--only" in args:
        i = args.index("--only")
        only = args[i + 1]
        del args[i : i + 2]
    results = {}
    default_threads = torch.get_num_threads()
    for name, tp, threads, env in CONFIGS:
        if not name.startswith(only):
            continue
        torch.set_num_threads(threads or default_threads)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # (the rank processes inherit it)
        start = time.perf_counter()
        try:
            engine = LLMEngine.from_engine_args(EngineArgs(
                tensor_parallel_size=tp, max_num_seqs=64, max_num_batched_tokens=2048,
                num_kv_blocks=1024, enable_prefix_caching=False))
            load_s = time.perf_counter() - start
            try:
                res = measure(engine)
            finally:
                engine.shutdown()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        res["load_s"] = load_s
        results[name] = res
        print(name, {k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()
                     if k != "greedy"}, flush=True)
    ref = results[CONFIGS[0][0]]["greedy"] if CONFIGS[0][0] in results else None
    if ref is None:
        ref = next(iter(results.values()))["greedy"]
    for name, res in results.items():
        same = sum(a == b for a, b in zip(ref, res["greedy"], strict=True))
        first = [next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                 for a, b in zip(ref, res["greedy"], strict=True)]
        print(f"{name}: greedy sequences equal to TP=1's: {same}/6; first differing token: {first}")
    if args:
        with open(args[0], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
