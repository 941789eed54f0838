"""The contracts between the engine's parts carry what they mean as data: a step
returns its outputs with its stats, a parameter error names its field, the
output processor alone maps a request's n samples to it, one EngineArgs builds
every entry point's configs, values computed by the engine travel with the
request, and process-wide settings belong to the entry points."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from pathlib import Path
from typing import Any

import pytest

from tests.hf_models import TEST_DEVICE, build_hf_model, save_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.cli import build_parser
from tokenmill.config import ServerConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.iteration_stats import IterationStats
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.source import ModelNotFoundError, default_model_path
from tokenmill.sampling_params import ParamError, RequestOutputKind
from tokenmill.server.errors import APIError
from tokenmill.server.serving import Prompt, Serving

TINY = {"dtype": "float32", "device": TEST_DEVICE, "skip_tokenizer_init": True,
        "num_kv_blocks": 64, "block_size": 4}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_hf_model(build_hf_model("llama"), Path(tmp_path_factory.mktemp("llama")))


def sampled(n: int, max_tokens: int = 4, **kwargs: Any) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True,
                          **kwargs)


# ---- EngineArgs ------------------------------------------------------------------------


def test_engine_args_build_the_same_configs_for_the_cli_and_llm(tiny_path: str) -> None:
    cli = ["--model", tiny_path, "--tokenizer", "tok", "--dtype", "float32", "--device", "cpu",
           "--seed", "3", "--block-size", "4", "--max-num-seqs", "7",
           "--max-num-batched-tokens", "64", "--max-model-len", "100",
           "--kv-cache-memory-bytes", "4096", "--num-kv-blocks", "9",
           "--no-enable-prefix-caching", "--scheduling-policy", "priority",
           "--skip-tokenizer-init"]
    api = EngineArgs(model=tiny_path, tokenizer="tok", dtype="float32", device="cpu", seed=3,
                     block_size=4, max_num_seqs=7, max_num_batched_tokens=64, max_model_len=100,
                     kv_cache_memory_bytes=4096, num_kv_blocks=9, enable_prefix_caching=False,
                     scheduling_policy="priority", skip_tokenizer_init=True)
    for command in (["generate", "hi"], ["serve"]):
        parsed = EngineArgs.from_cli_args(build_parser().parse_args([*command, *cli]))
        assert parsed == api
        assert parsed.create_engine_configs() == api.create_engine_configs()
        # The flags' defaults are EngineArgs' defaults.
        default = EngineArgs.from_cli_args(build_parser().parse_args(command))
        assert default == EngineArgs()

    # LLM's keyword arguments are EngineArgs' fields, and its engine is built from them.
    kwargs = {**TINY, "max_num_seqs": 3, "max_model_len": 100}
    llm = LLM(tiny_path, apply_process_settings=False, **kwargs)
    engine = llm.engine
    assert (engine.model_config, engine.cache_config, engine.scheduler_config) == (
        EngineArgs(model=tiny_path, **kwargs).create_engine_configs()
    )
    with pytest.raises(TypeError):
        LLM(tiny_path, no_such_option=1)


def test_only_the_server_takes_the_smaller_cpu_budget() -> None:
    args = EngineArgs()
    assert args.create_engine_configs()[2].max_num_batched_tokens == 2048
    assert args.with_serve_defaults().create_engine_configs()[2].max_num_batched_tokens == 160
    given = dataclasses.replace(args, max_num_batched_tokens=512)
    assert given.with_serve_defaults() == given


# ---- process-wide settings -------------------------------------------------------------


def test_llm_applies_process_settings_unless_told_not_to_and_an_engine_never(tiny_path: str) -> None:
    gc.unfreeze()
    try:
        LLMEngine.from_engine_args(EngineArgs(model=tiny_path, **TINY))
        assert gc.get_freeze_count() == 0
        LLM(tiny_path, apply_process_settings=False, **TINY)
        assert gc.get_freeze_count() == 0
        LLM(tiny_path, **TINY)
        assert gc.get_freeze_count() > 0
    finally:
        gc.freeze()  # as the other tests' LLMs left it


def test_an_engine_gives_loading_s_freed_memory_back_before_it_allocates_the_kv_cache(
        tiny_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenmill.engine.llm_engine as llm_engine

    calls: list[str] = []
    runner = llm_engine.ModelRunner

    def trim() -> bool:
        calls.append("trim")
        return True

    def make_runner(*args: Any, **kwargs: Any) -> Any:
        calls.append("runner (the KV cache)")
        return runner(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "trim_heap", trim)
    monkeypatch.setattr(llm_engine, "ModelRunner", make_runner)
    monkeypatch.setattr(llm_engine, "free_heap_bytes", lambda: llm_engine.TRIM_AFTER_LOAD_BYTES)
    LLMEngine.from_engine_args(EngineArgs(model=tiny_path, **TINY))
    assert calls == ["trim", "runner (the KV cache)"]
    # A small load leaves the heap's free pages alone (kept for reuse: process_settings).
    calls.clear()
    monkeypatch.setattr(llm_engine, "free_heap_bytes", lambda: llm_engine.TRIM_AFTER_LOAD_BYTES - 1)
    LLMEngine.from_engine_args(EngineArgs(model=tiny_path, **TINY))
    assert calls == ["runner (the KV cache)"]


# ---- step() and n > 1 ------------------------------------------------------------------


def test_step_returns_outputs_and_stats_and_n_samples_map_to_their_request(tiny_path: str) -> None:
    engine = LLM(tiny_path, apply_process_settings=False, check_integrity=True, **TINY).engine
    engine.add_request("q", {"prompt_token_ids": [5] * 6},
                       sampled(3, 8, output_kind=RequestOutputKind.DELTA))
    engine.add_request("1_x", {"prompt_token_ids": [6] * 6}, sampled(1, 8))  # an id like a child's
    children = engine.output_processor.core_request_ids("q")
    assert len(children) == 3 and set(children) <= set(engine.scheduler.requests)
    assert engine.output_processor.core_request_ids("1_x") == ["1_x"]

    result = engine.step()
    # Three samples and one plain request admitted: queue time is the callers' requests'.
    assert result.stats.num_scheduled_reqs == 4
    assert sorted(result.stats.first_scheduled_req_ids) == ["1_x", "q"]
    assert {o.request_id for o in result.outputs} == {"q", "1_x"}
    [parent] = [o for o in result.outputs if o.request_id == "q"]
    assert sorted(c.index for c in parent.outputs) == [0, 1, 2]
    assert engine.step().stats.first_scheduled_req_ids == ()

    # Aborting the request aborts its samples, found through the map.
    [aborted] = engine.abort_request(["q"])
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert not set(children) & set(engine.scheduler.requests)
    engine.abort_request(["1_x"])
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_async_engine_counts_one_queue_time_for_n_samples(tiny_path: str) -> None:
    served = AsyncEngine(lambda: LLMEngine.from_engine_args(EngineArgs(model=tiny_path, **TINY)))
    queue_times: list[float] = []

    def record(stats: IterationStats) -> None:
        queue_times.extend(stats.queue_times_s)

    served.add_stat_logger(record)

    async def run() -> int:
        stream = await served.add_request("p", {"prompt_token_ids": [5] * 6}, sampled(3))
        return sum([len(c.token_ids) for out in [o async for o in stream] for c in out.outputs])

    try:
        assert asyncio.run(asyncio.wait_for(run(), 60)) == 12
        assert len(queue_times) == 1
    finally:
        served.shutdown()


# ---- ParamError ------------------------------------------------------------------------


class _RefusingEngine:
    """Just enough of AsyncEngine for Serving.start: it refuses every request."""

    def __init__(self, error: ValueError) -> None:
        self.error = error
        self.aborted: list[str] = []

    def num_waiting_requests(self) -> int:
        return 0

    async def add_request(self, *args: object) -> None:
        raise self.error

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.mark.parametrize(("error", "param"), [
    (ParamError("the message does not start with the field", "logit_bias"), "logit_bias"),
    (ValueError("prompt is not a field of a plain ValueError"), None),
])
def test_the_server_reads_the_param_from_the_error(error: ValueError, param: str | None) -> None:
    serving = Serving(_RefusingEngine(error), ServerConfig(), "m")  # type: ignore[arg-type]
    with pytest.raises(APIError) as info:
        asyncio.run(serving.start("r", [Prompt(None, [1, 2])], [SamplingParams()], 0))
    assert (info.value.status_code, info.value.message, info.value.param) == (400, str(error), param)


# ---- values the engine computes travel with the request ----------------------------------


def test_bad_words_token_ids_travel_with_the_request_not_the_params() -> None:
    try:
        default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(kv_cache_memory_bytes=16 << 20, apply_process_settings=False)
    engine = llm.engine
    params = SamplingParams(bad_words=[" Paris"], max_tokens=2)
    engine.add_request("bw", "The capital of France is", params)
    expected = llm.get_tokenizer().bad_words_token_ids([" Paris"])
    assert expected and engine.scheduler.requests["bw"].bad_words_token_ids == expected
    assert "bad_words_token_ids" not in {f.name for f in dataclasses.fields(SamplingParams)}
    scheduled = engine.schedule()
    [request] = scheduled.scheduler_output.scheduled
    assert request.bad_words_token_ids == expected
    result = engine.execute(scheduled)
    assert engine.runner.requests["bw"].bad_words_token_ids == expected
    assert result.stats.first_scheduled_req_ids == ("bw",)
    engine.abort_request(["bw"])
