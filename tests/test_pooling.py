"""Pooling requests (embeddings) equal transformers' last hidden state pooled
the same way, under every batching situation, and beside generation.

Tiny random models from transformers configs: Qwen3 as a decoder embedding
model (no sentence-transformers files: the last token, normalised, as
Qwen3-Embedding), Llama with sentence-transformers' modules.json for mean and
CLS pooling. The oracle runs each prompt alone (batch 1) through
transformers' base model; ours run all 32 together, in chunks, preempted,
with prefix hits, one at a time, and mixed with greedy generation, whose
tokens must stay transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hf_models import (
    TEST_DEVICE,
    VOCAB_SIZE,
    build_hf_model,
    hf_embedding,
    hf_greedy,
    save_hf_model,
)
from tokenmill import LLM, PoolingParams, PoolingRequestOutput, RequestOutput, SamplingParams
from tokenmill.sampling_params import ParamError

NUM_PROMPTS = 32
ATOL = 1e-5


def make_prompts() -> list[list[int]]:
    rng = np.random.default_rng(4321)
    shared = rng.integers(3, VOCAB_SIZE, size=24).tolist()
    prompts = []
    for i in range(NUM_PROMPTS):
        tail = rng.integers(3, VOCAB_SIZE, size=int(rng.integers(1, 60))).tolist()
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


PROMPTS = make_prompts()


def write_sentence_transformers(path: str, pooling: str, normalize: bool = True) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    Path(path, "modules.json").write_text(json.dumps(modules))
    Path(path, "1_Pooling").mkdir()
    modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": pooling == "last"}
    Path(path, "1_Pooling", "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **modes, "include_prompt": True}))


CASES = {  # name: (arch, sentence-transformers pooling or None, normalize)
    "qwen3-last": ("qwen3", None, True),
    "llama-mean": ("llama", "mean", True),
    "llama-cls": ("llama", "cls", False),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch, pooling, normalize = CASES[request.param]
    model = build_hf_model(arch)
    path = save_hf_model(model, Path(tmp_path_factory.mktemp(request.param)))
    if pooling is not None:
        write_sentence_transformers(path, pooling, normalize)
    refs = [hf_embedding(model, p, pooling or "last", normalize) for p in PROMPTS]
    return {"name": request.param, "model": model, "path": path, "refs": refs}


SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {"num_kv_blocks": 512},
    "budget8": {"max_num_batched_tokens": 8, "num_kv_blocks": 512},
    "prefix": {"block_size": 4, "num_kv_blocks": 1024},
    "one-seq": {"max_num_seqs": 1, "num_kv_blocks": 512},
}
# Beside generation: chunked prefills among decodes, and a pool so small that
# decoding requests preempt the latest admitted (pooling ones among them).
MIXED: dict[str, dict[str, Any]] = {
    "chunked": {"max_num_batched_tokens": 16, "num_kv_blocks": 512},
    "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 16},
}


def make_llm(path: str, **kwargs: Any) -> LLM:
    return LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
               check_integrity=True, apply_process_settings=False, **kwargs)


def assert_pool_empty(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert not scheduler.requests
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_embeddings_match_transformers(case: dict[str, Any], scenario: str) -> None:
    llm = make_llm(case["path"], **SCENARIOS[scenario])
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, case["refs"], strict=True)):
        assert out.finished and out.prompt_token_ids == PROMPTS[i]
        np.testing.assert_allclose(out.outputs.embedding, ref, atol=ATOL, err_msg=f"prompt {i}")
    assert_pool_empty(llm)
    scheduler = llm.engine.scheduler
    if scenario == "prefix":  # the last token only: hits are taken; mean and CLS take none
        assert (scheduler.prefix_cache_hits > 0) == (case["name"] == "qwen3-last")


def test_batch_of_one_equals_batch_of_32(case: dict[str, Any]) -> None:
    llm = make_llm(case["path"], num_kv_blocks=512)
    together = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for i in (0, 7, 31):
        alone = llm.embed({"prompt_token_ids": PROMPTS[i]}, use_tqdm=False)[0]
        np.testing.assert_allclose(alone.outputs.embedding, together[i].outputs.embedding, atol=ATOL)


@pytest.mark.parametrize("scenario", list(MIXED))
def test_mixed_with_generation(case: dict[str, Any], scenario: str) -> None:
    """Pooling and greedy generation requests in the same steps, a small budget
    so prefills are chunked beside decodes: both equal transformers'."""
    llm = make_llm(case["path"], **MIXED[scenario])
    engine = llm.engine
    gen_refs = {f"g{i}": hf_greedy(case["model"], PROMPTS[i], 12) for i in range(0, NUM_PROMPTS, 2)}
    for i in range(NUM_PROMPTS):
        if f"g{i}" in gen_refs:
            engine.add_request(f"g{i}", {"prompt_token_ids": PROMPTS[i]},
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        engine.add_request(f"e{i}", {"prompt_token_ids": PROMPTS[i]}, PoolingParams())
    done: dict[str, Any] = {}
    num_shared_steps = 0  # steps where a decode and a pooling chunk ran together
    while engine.has_unfinished_requests():
        step = engine.schedule()
        scheduled = step.scheduler_output.scheduled
        num_shared_steps += (any(r.pooling_params is not None for r in scheduled)
                             and any(r.num_tokens == 1 and r.do_sample for r in scheduled))
        for out in engine.execute(step).outputs:
            if out.finished:
                done[out.request_id] = out
    for i in range(NUM_PROMPTS):
        pooled = done[f"e{i}"]
        assert isinstance(pooled, PoolingRequestOutput)
        np.testing.assert_allclose(pooled.outputs.data, case["refs"][i], atol=ATOL)
    for request_id, (tokens, _) in gen_refs.items():
        out = done[request_id]
        assert isinstance(out, RequestOutput) and out.outputs[0].token_ids == tokens
    assert_pool_empty(llm)
    assert num_shared_steps > 0  # neither kind waits for the other to drain
    if scenario == "preempt":
        assert any(o.metrics is not None and o.metrics.num_preemptions for o in done.values()
                   if isinstance(o, PoolingRequestOutput))


def test_normalize_off_and_score(case: dict[str, Any]) -> None:
    if case["name"] != "qwen3-last":
        pytest.skip("one model is enough")
    llm = make_llm(case["path"], num_kv_blocks=512)
    raw = llm.embed({"prompt_token_ids": PROMPTS[3]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    expected = hf_embedding(case["model"], PROMPTS[3], "last", normalize=False)
    np.testing.assert_allclose(raw.outputs.embedding, expected, atol=ATOL)
    a, b = (hf_embedding(case["model"], p, "last", True) for p in (PROMPTS[1], PROMPTS[2]))
    [score] = llm.score({"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[2]},
                        use_tqdm=False)
    assert score.outputs.score == pytest.approx(float(np.dot(a, b)), abs=ATOL)


def test_matryoshka_dimensions(tmp_path: Path) -> None:
    model = build_hf_model("qwen3")
    plain = save_hf_model(model, tmp_path / "plain")
    llm = make_llm(plain, num_kv_blocks=64)
    with pytest.raises(ParamError, match="Matryoshka") as e:
        llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=16), use_tqdm=False)
    assert e.value.param == "dimensions"
    assert_pool_empty(llm)

    model.config.matryoshka_dimensions = [16, 32, 64]
    trained = save_hf_model(model, tmp_path / "trained")
    llm = make_llm(trained, num_kv_blocks=64)
    out = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=16), use_tqdm=False)[0]
    full = hf_embedding(model, PROMPTS[0], "last", normalize=False)[:16]
    np.testing.assert_allclose(out.outputs.embedding, full / np.linalg.norm(full), atol=ATOL)
    with pytest.raises(ParamError, match=r"\[16, 32, 64\]"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=24), use_tqdm=False)

    model.config.matryoshka_dimensions = None
    model.config.is_matryoshka = True
    any_width = save_hf_model(model, tmp_path / "any")
    llm = make_llm(any_width, num_kv_blocks=64)
    with pytest.raises(ParamError, match="at most the model's embedding size 64"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ParamError, match="dimensions must be an integer >= 1"):
        PoolingParams(dimensions=0)


def test_runner_refuses_the_other_kind(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("qwen3"), tmp_path)
    generate_only = make_llm(path, num_kv_blocks=64, runner="generate")
    with pytest.raises(ValueError, match="runner='generate'"):
        generate_only.embed({"prompt_token_ids": [5, 6]}, use_tqdm=False)
    pooling_only = make_llm(path, num_kv_blocks=64, runner="pooling")
    with pytest.raises(ValueError, match="runner='pooling'"):
        pooling_only.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False)
    assert len(pooling_only.embed({"prompt_token_ids": [5, 6]}, use_tqdm=False)[0].outputs.embedding) == 64


def test_unsupported_pooling_mode_is_refused(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("llama"), tmp_path)
    write_sentence_transformers(path, "mean")
    config = Path(path, "1_Pooling", "config.json")
    cfg = json.loads(config.read_text())
    cfg["pooling_mode_max_tokens"], cfg["pooling_mode_mean_tokens"] = True, False
    config.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        make_llm(path, num_kv_blocks=64)
