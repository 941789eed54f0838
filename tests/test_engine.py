"""The engine keeps serving: bad requests are refused with a clear error, aborts
free their blocks, and the default model answers a real question."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.hf_models import TEST_DEVICE, build_hf_model, save_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.model.source import ModelNotFoundError, default_model_path


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_hf_model(build_hf_model("llama"), Path(tmp_path_factory.mktemp("llama")))
    return LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
               num_kv_blocks=64, block_size=4, max_model_len=200, check_integrity=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run_to_end(llm: LLM) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(1000):
        if not llm.engine.has_unfinished_requests():
            break
        for out in llm.engine.step().outputs:
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_a_request_that_cannot_run_is_refused_and_the_others_finish(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    for i in range(3):
        engine.add_request(f"ok{i}", {"prompt_token_ids": [5 + i] * 10}, greedy(8))
    engine.step()
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("long", {"prompt_token_ids": [7] * 201}, greedy(4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad-id", {"prompt_token_ids": [1, 10**6]}, greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, greedy(4))
    done = run_to_end(tiny_llm)
    assert sorted(done) == ["ok0", "ok1", "ok2"]
    assert all(len(t) == 8 for t in done.values())
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_generation_stops_at_max_model_len(tiny_llm: LLM) -> None:
    # 64 blocks of 4 tokens hold 256 tokens, so max_model_len 200 stands.
    assert tiny_llm.engine.max_model_len == 200
    out = tiny_llm.generate({"prompt_token_ids": [9] * 195}, greedy(50), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5  # stopped at the context length
    assert out[0].outputs[0].finish_reason == "length"


def test_generate_checks_every_prompt_before_running_any(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens"):
        tiny_llm.generate([{"prompt_token_ids": [3] * 5}, {"prompt_token_ids": [3] * 300}],
                          greedy(4), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        tiny_llm.generate("text needs a tokenizer", greedy(4), use_tqdm=False)
    # Refused by the engine after the first was queued (its options, an empty
    # prompt, a bad priority): the first does not run either.
    for prompts, params, priority, match in [
        ([[3] * 5, [4] * 5], [greedy(4), SamplingParams(stop_token_ids=[10**6])], None, "stop_token_ids"),
        ([[3] * 5, []], greedy(4), None, "empty"),
        ([[3] * 5, [4] * 5], greedy(4), [0, 1], "scheduling_policy='priority'"),
        ([[3] * 5, [4] * 5], greedy(4), [0, "1"], "priority must be an integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params,  # type: ignore[arg-type]
                              use_tqdm=False, priority=priority)
        assert not tiny_llm.engine.has_unfinished_requests()
        tiny_llm.engine.scheduler.check_integrity()
    for bad in ("123", [1, None], [[1, 2]], 7, [True]):
        with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
            tiny_llm.generate({"prompt_token_ids": bad}, greedy(2), use_tqdm=False)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="a prompt is a string"):
        tiny_llm.generate({"prompt": None}, greedy(2), use_tqdm=False)  # type: ignore[dict-item]
    assert len(tiny_llm.generate({"prompt_token_ids": [3] * 5}, greedy(2), use_tqdm=False)) == 1


def test_abort_frees_blocks_at_once(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    engine.add_request("a", {"prompt_token_ids": [4] * 30}, greedy(50))
    engine.add_request("b", {"prompt_token_ids": [6] * 30}, greedy(5))
    engine.step()
    engine.step()
    assert engine.scheduler.kv.block_ids("a")
    outs = engine.abort_request(["a"])
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    assert engine.scheduler.kv.block_ids("a") == []
    engine.scheduler.check_integrity()
    assert sorted(run_to_end(tiny_llm)) == ["b"]
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_priority_policy_runs_urgent_requests_first(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("llama"), tmp_path)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate([{"prompt_token_ids": [5] * 4}] * 3, greedy(3), use_tqdm=False,
                        priority=[2, 0, 1])
    first_token_times = [o.metrics.first_token_time for o in outs if o.metrics]
    order = sorted(range(3), key=lambda i: first_token_times[i] or 0.0)
    assert order == [1, 2, 0]
    # One at a time (max_num_seqs=1): each waited in the queue for those before it.
    queue_times = [o.metrics.queue_time for o in outs if o.metrics]
    assert all(q is not None and q >= 0 for q in queue_times)
    assert queue_times[0] > queue_times[2] > queue_times[1]  # type: ignore[operator]
    for o in outs:
        assert o.metrics is not None and o.metrics.first_scheduled_time is not None
        assert o.metrics.arrival_time <= o.metrics.first_scheduled_time <= (o.metrics.first_token_time or 0)
    # A priority that is not an integer is refused before it reaches the queue's
    # ordering (which it once broke for every later request).
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate([{"prompt_token_ids": [5] * 4}] * 2, greedy(3), use_tqdm=False, priority=[1, "0"])  # type: ignore[list-item]
    llm.engine.scheduler.check_integrity()
    assert len(llm.generate([{"prompt_token_ids": [5] * 4}], greedy(3), use_tqdm=False)) == 1


def test_default_model_answers_paris() -> None:
    try:
        default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(kv_cache_memory_bytes=64 << 20)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    completion = out[0].outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # the model ended its answer with <|im_end|>


def test_the_startup_heap_is_frozen_and_engines_still_free(tiny_llm: LLM) -> None:
    # process_settings.freeze_gc_heap: the collector's full passes skip the engine's objects ...
    import gc
    import weakref

    from tokenmill.engine.async_engine import AsyncEngine

    tracked = {id(o) for o in gc.get_objects()}
    engine = tiny_llm.engine
    assert not {id(engine), id(engine.scheduler), id(engine.runner)} & tracked
    # ... so an engine must go without the collector once unreferenced, or it would never go.
    path = str(engine.source.path)
    gc.disable()
    try:
        kwargs = {"dtype": "float32", "device": TEST_DEVICE, "skip_tokenizer_init": True, "num_kv_blocks": 64}
        llm = LLM(path, **kwargs)  # type: ignore[arg-type]
        ref = weakref.ref(llm.engine)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(3), use_tqdm=False)
        del llm
        assert ref() is None
        served = AsyncEngine(lambda: LLM(path, **kwargs).engine)  # type: ignore[arg-type]
        refs = weakref.ref(served), weakref.ref(served.engine)
        served.shutdown()
        del served
        assert refs[0]() is None and refs[1]() is None
    finally:
        gc.enable()


def test_generate_stats_time_each_part_of_the_steps(tiny_llm: LLM) -> None:
    from tokenmill.bench.throughput import STEP_PHASES
    from tokenmill.worker.step_timer import StepPhase

    assert tuple(p.value for p in StepPhase) == STEP_PHASES  # the same names, in order
    llm = tiny_llm
    llm.generate([{"prompt_token_ids": list(range(1, 30))}, {"prompt_token_ids": [5, 6, 7]}],
                 greedy(6), use_tqdm=False)
    stats = llm.last_generate_stats
    assert set(stats.phase_s) == set(STEP_PHASES)
    assert all(s > 0 for s in stats.phase_s.values()), stats.phase_s
    assert sum(stats.phase_s.values()) <= stats.wall_time_s
    # Per step, too: step() returns its outputs with its stats, whose parts are its
    # own (the timer starts again each step).
    llm.engine.add_request("solo", {"prompt_token_ids": [1, 2]}, greedy(1))
    start = time.perf_counter()
    result = llm.engine.step()
    step_s = time.perf_counter() - start
    assert [o.request_id for o in result.outputs if o.finished] == ["solo"]
    phases = result.stats.phase_s
    assert set(phases) == set(StepPhase) and sum(phases.values()) <= step_s
    assert (result.stats.num_scheduled_tokens, result.stats.num_scheduled_reqs) == (2, 1)
    assert result.stats.first_scheduled_req_ids == ("solo",)
    run_to_end(llm)


_REUSE_CHECK = """
import resource
import torch
from tokenmill.engine.process_settings import keep_freed_memory

assert keep_freed_memory()

def faults_of_one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(48 << 20, dtype=torch.uint8)  # [48 MiB]
    block.fill_(1)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

# The heap grows, at first in steps: a block is reused once the heap holds it
# (without the setting each one is mapped fresh and unmapped again: never reused).
print(min(faults_of_one_block() for _ in range(8)))
"""


def test_freed_activations_are_reused_without_page_faults() -> None:
    # process_settings.keep_freed_memory: a block above glibc's mmap threshold (32 MiB at
    # most) came back as fresh pages every time, a fault per 4 KiB page. In a fresh
    # process: the suite's own heap history (hundreds of models loaded) decides where
    # glibc places a block, which is not what this checks.
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    out = subprocess.run([sys.executable, "-c", _REUSE_CHECK], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 1000  # (12,288 pages of 4 KiB when mapped fresh)
    unset = subprocess.run([sys.executable, "-c", _REUSE_CHECK.replace("assert keep_freed_memory()", "")],
                           capture_output=True, text=True, check=True)
    assert int(unset.stdout.split()[-1]) > 10000  # (what the setting changes)


def test_the_kv_cache_is_faulted_in_at_start(tiny_llm: LLM) -> None:
    # worker/model_runner.zeros: a step that first touched a page of the cache stalled.
    import resource
    import sys

    import torch

    if not sys.platform.startswith("linux") or tiny_llm.engine.device.type != "cpu":
        pytest.skip("CPU page faults counted through Linux's getrusage")
    torch.ones(1 << 16).view(torch.uint8)[::4096].add_(0)  # (the first call's own faults)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for kv in tiny_llm.engine.runner.kv_caches:  # (32 pages of 4 KiB here)
        kv.view(-1).view(torch.uint8)[::4096].add_(0)
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before <= 2


def test_a_kv_cache_larger_than_free_memory_is_refused(
    tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from tokenmill.config import CacheConfig
    from tokenmill.worker import cache_sizing

    spec = tiny_llm.engine.spec
    per_block = cache_sizing.bytes_per_block(spec, torch.float32, 16)
    monkeypatch.setattr(cache_sizing, "available_cpu_memory_bytes", lambda: 10 * per_block)
    cpu = torch.device("cpu")
    assert cache_sizing.num_kv_blocks(spec, torch.float32, CacheConfig(num_blocks_override=10), cpu) == 10
    with pytest.raises(ValueError, match="lower kv_cache_memory_bytes"):
        cache_sizing.num_kv_blocks(spec, torch.float32, CacheConfig(num_blocks_override=11), cpu)
    with pytest.raises(ValueError, match="lower kv_cache_memory_bytes"):
        cache_sizing.num_kv_blocks(
            spec, torch.float32, CacheConfig(kv_cache_memory_bytes=11 * per_block), cpu)
    # Where free memory is unknown (no /proc/meminfo), the default budget, unchecked.
    monkeypatch.setattr(cache_sizing, "available_cpu_memory_bytes", lambda: None)
    assert cache_sizing.num_kv_blocks(spec, torch.float32, CacheConfig(), cpu) == (
        cache_sizing.DEFAULT_CPU_KV_BYTES // per_block)
