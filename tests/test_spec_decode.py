"""Speculative decoding: exact against transformers' greedy, and the pieces.

The engine tests run 32 prompts (half of them repeat a stretch of themselves,
so prompt lookup finds drafts, and the others only what the output repeats)
through tokenmill with speculation, under a budget of 8 tokens a step and a KV
pool small enough to force preemption, the KV cache checked after every step,
and compare every token and logprob with transformers' greedy decoding (n-gram
speculation on a tiny Llama and a tiny Phi-4-mini: partial rotary, LongRoPE).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hf_models import TEST_DEVICE, VOCAB_SIZE, build_hf_model, hf_greedy, save_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer

NUM_PROMPTS = 32


def make_prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(35)
    prompts = []
    for i in range(NUM_PROMPTS):
        length = int(rng.integers(2, 40))
        tokens = rng.integers(3, VOCAB_SIZE, size=length).tolist()
        if i % 2:  # a passage and the start of its copy: prompt lookup's case
            tokens = tokens + tokens[: max(1, length // 2)]
        prompts.append(tokens)
    max_tokens = rng.integers(4, 24, size=NUM_PROMPTS).tolist()
    return prompts, max_tokens


PROMPTS, MAX_TOKENS = make_prompts()
NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3, "disable_by_batch_size": 64}


def _target(arch: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = build_hf_model(arch)
    path = save_hf_model(model, Path(tmp_path_factory.mktemp("target")))
    refs = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    return {"path": path, "refs": refs}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _target("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def family_targets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each family's target (tests/hf_models.ARCHS), built once on first use: Phi-4-mini's
    kind (partial rotary, LongRoPE within its original context), the mixtures of experts,
    Gemma's windows and soft-caps."""
    made: dict[str, dict[str, Any]] = {}

    def get(arch: str) -> dict[str, Any]:
        if arch not in made:
            made[arch] = _target(arch, tmp_path_factory)
        return made[arch]

    return get


SCENARIOS: dict[str, dict[str, Any]] = {
    # The brief's case: 8 tokens a step and a pool so small that requests are preempted.
    "budget8-preempt": {"max_num_batched_tokens": 8, "num_kv_blocks": 20, "block_size": 4},
    # Every block full of accepted tokens becomes a prefix-cache entry.
    "prefix": {"num_kv_blocks": 2048, "block_size": 4},
}


def run_greedy(path: str, spec: dict[str, Any], **kwargs: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
              check_integrity=True, apply_process_settings=False, speculative_config=spec,
              **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, outputs


def assert_matches_oracle(llm: LLM, outputs: list[Any], refs: list[Any]) -> None:
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, refs, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}"
        assert completion.finish_reason == "length"
        ours = [entry[tok].logprob for entry, tok in zip(completion.logprobs, ref_tokens,
                                                        strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
    assert not scheduler.requests


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", ["llama", "phi4-mini", "qwen3-moe", "mixtral", "gpt-oss", "gemma3", "gemma2"])
def test_ngram_greedy_matches_transformers(request: pytest.FixtureRequest, arch: str, scenario: str) -> None:
    target: dict[str, Any] = (request.getfixturevalue("target") if arch == "llama" else
                              request.getfixturevalue("family_targets")(arch))
    options = dict(SCENARIOS[scenario])
    if arch in ("gemma3", "gemma2") and scenario == "budget8-preempt":
        options["num_kv_blocks"] = 12  # (windowed layers give blocks back: less memory to preempt)
    llm, outputs = run_greedy(target["path"], NGRAM, **options)
    assert_matches_oracle(llm, outputs, target["refs"])
    stats = llm.engine.stats().spec_decoding
    assert stats is not None
    # Drafts were verified, some accepted and some rejected (both paths ran).
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    if scenario == "budget8-preempt":
        assert llm.engine.stats().num_preemptions > 0
    else:
        # Each prompt + its output again: every full block of computed tokens (all
        # but the last output token) is a hit, accepted drafts' blocks included.
        again = [{"prompt_token_ids": p + o.outputs[0].token_ids}
                 for p, o in zip(PROMPTS, outputs, strict=True)]
        hits = llm.generate(again, SamplingParams(max_tokens=1), use_tqdm=False)
        for prompt, out in zip(again, hits, strict=True):
            assert out.num_cached_tokens == (len(prompt["prompt_token_ids"]) - 1) // 4 * 4


# ---- the n-gram proposer --------------------------------------------------------------


def test_ngram_proposes_what_followed_the_earliest_longest_match() -> None:
    proposer = NgramProposer(1, 3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7]
    # The 3-gram 5 6 7 occurs at 0: what followed it there.
    assert proposer.propose(tokens, 3) == [8, 9, 6]
    assert proposer.propose(tokens, 1) == [8]
    # Only a 1-gram matches (9 at 4): the earliest place.
    assert proposer.propose([9, 1, 2, 3, 9], 2) == [1, 2]
    # Nothing matches, or too short: no drafts.
    assert proposer.propose([1, 2, 3, 4], 2) == []
    assert proposer.propose([1], 2) == []
    # The drafts may run into the suffix itself (a repeating run), but not past the end.
    assert NgramProposer(2, 2).propose([4, 4, 4], 5) == [4]


def test_ngram_min_length_is_respected() -> None:
    assert NgramProposer(2, 3).propose([9, 1, 2, 3, 9], 2) == []


# ---- the config -------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "field"), [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
     "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
])
def test_bad_speculative_config_names_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(options)


def test_speculative_config_defaults_as_vllm() -> None:
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 3})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 3}).method == \
        "draft_model"


# ---- sampled requests ---------------------------------------------------------------------


def test_seeded_sampling_is_the_same_with_and_without_speculation(target: dict[str, Any]) -> None:
    """Each kept token is the one decoding alone draws with the same uniform, and a
    seeded request's generator moves one draw per kept token: so its tokens, their
    target logprobs and where stop tokens / min_tokens / max_tokens cut it are
    those of plain decoding, under a budget of 8 and preemption."""
    rng = np.random.default_rng(7)
    params = []
    for i, n in enumerate(MAX_TOKENS):
        stop = [int(t) for t in rng.integers(3, VOCAB_SIZE, size=3)] if i % 3 == 0 else []
        params.append(SamplingParams(
            temperature=0.3 + 0.2 * (i % 4), top_p=0.9 if i % 2 else 1.0, top_k=40 if i % 5 else 0,
            seed=1000 + i, max_tokens=n, min_tokens=3 if i % 4 == 1 else 0, stop_token_ids=stop,
            ignore_eos=i % 2 == 0, logprobs=1))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:16]]
    params = params[:16]
    runs = []
    for spec in (None, NGRAM):
        llm = LLM(target["path"], dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
                  check_integrity=True, apply_process_settings=False, speculative_config=spec,
                  **SCENARIOS["budget8-preempt"])
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    stats = llm.engine.stats().spec_decoding
    assert stats is not None and stats.num_accepted_tokens > 0
    num_stopped = 0
    for i, (plain, spec_out) in enumerate(zip(*runs, strict=True)):
        a, b = plain.outputs[0], spec_out.outputs[0]
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason), f"prompt {i}"
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([v.logprob for v in y.values()],
                                       [v.logprob for v in x.values()], atol=1e-4)
        num_stopped += a.finish_reason == "stop"
    assert num_stopped > 0  # (a stop token cut some run)


# The rejection-sampling check: a target distribution p_0, p_1 over a vocabulary
# of 6 at two positions, drafts d_1 = 1, d_2 = 3. The first token must follow p_0,
# and the second, given the first was d_1, p_1. Pearson's chi-square with a fixed
# seed; the critical value for 5 degrees of freedom at 0.001 is 20.515.
CHI2_CRITICAL_DF5 = 20.515
TARGET_LOGITS = [[0.5, 1.2, 0.1, -0.4, 0.9, 0.0], [0.2, -0.3, 0.8, 1.1, 0.0, 0.4],
                 [0.0, 0.3, -0.2, 0.6, 0.1, 0.2]]
DRAFTS = [1, 3]
NUM_TRIALS = 20000

# A verifier: (target logits [k + 1, vocab], drafts, trials, seed) -> each trial's kept run.
Verifier = Any


def engine_verifier(logits: Any, drafts: list[int], trials: int, seed: int) -> list[list[int]]:
    """The runner's own verification: the Sampler over each trial's rows (the
    per-row states), then verify_drafts."""
    import torch

    from tokenmill.core.contracts import ScheduledRequest
    from tokenmill.worker.drafter import speculative_row_states, verify_drafts
    from tokenmill.worker.request_state import CachedRequestState
    from tokenmill.worker.sampler import Sampler

    sampler = Sampler(torch.device("cpu"), seed=seed)
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(trials // 1000):
        reqs, rows = [], []
        for t in range(1000):
            state = CachedRequestState.create(str(t), [0], params, len(logits[0]),
                                              torch.device("cpu"))
            reqs.append(ScheduledRequest(str(t), [7, *drafts], 1, [0], params, do_sample=True,
                                         num_draft_tokens=len(drafts)))
            rows.extend(speculative_row_states(state, drafts))
        batch = torch.tensor(logits, dtype=torch.float32).repeat(1000, 1)
        runs.extend([token[0] for token in run]
                    for run in verify_drafts(sampler(batch, rows).rows(), reqs))
    return runs


def residual_keeps_the_draft(logits: Any, drafts: list[int], trials: int,
                             seed: int) -> list[list[int]]:
    """Wrong: accepts d with probability p(d) but, rejected, draws from all of p."""
    rng = np.random.default_rng(seed)
    probs = [np.exp(row) / np.exp(row).sum() for row in np.array(logits)]
    runs = []
    for _ in range(trials):
        run = []
        for i, d in enumerate([*drafts, None]):
            if d is not None and rng.random() < probs[i][d]:
                run.append(d)
                continue
            run.append(int(rng.choice(len(probs[i]), p=probs[i])))
            break
        runs.append(run)
    return runs


def accept_the_most_likely(logits: Any, drafts: list[int], trials: int,
                           seed: int) -> list[list[int]]:
    """Wrong: greedy verification of a sampled request (keep d when it is p's argmax)."""
    rng = np.random.default_rng(seed)
    probs = [np.exp(row) / np.exp(row).sum() for row in np.array(logits)]
    runs = []
    for _ in range(trials):
        run = []
        for i, d in enumerate([*drafts, None]):
            if d is not None and int(np.argmax(probs[i])) == d:
                run.append(d)
                continue
            run.append(int(rng.choice(len(probs[i]), p=probs[i])))
            break
        runs.append(run)
    return runs


def chi_square(observed: list[int], probs: np.ndarray) -> float:
    counts = np.bincount(observed, minlength=len(probs))
    expected = probs * len(observed)
    return float(((counts - expected) ** 2 / expected).sum())


def keeps_the_target_distribution(verify: Verifier) -> bool:
    runs = verify(TARGET_LOGITS, DRAFTS, NUM_TRIALS, 12345)
    probs = [np.exp(row) / np.exp(row).sum() for row in np.array(TARGET_LOGITS)]
    first = [run[0] for run in runs]
    second = [run[1] for run in runs if run[0] == DRAFTS[0] and len(run) > 1]
    return (chi_square(first, probs[0]) < CHI2_CRITICAL_DF5
            and chi_square(second, probs[1]) < CHI2_CRITICAL_DF5)


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    assert keeps_the_target_distribution(engine_verifier)


@pytest.mark.parametrize("wrong", [residual_keeps_the_draft, accept_the_most_likely])
def test_the_chi_square_check_fails_a_wrong_acceptance_rule(wrong: Verifier) -> None:
    assert not keeps_the_target_distribution(wrong)


def test_a_stop_string_inside_an_accepted_run_cuts_it_at_its_token(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Stop strings are matched in the text a token at a time, so a run of several
    accepted tokens is cut at the token that completes the string: text, token ids
    and reasons are those of plain decoding."""
    import torch
    import transformers

    from tests.hf_models import COMMON
    from tests.test_structured_outputs import build_tokenizer

    directory = tmp_path_factory.mktemp("stop")
    vocab_size = build_tokenizer(directory)
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": vocab_size})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        directory, safe_serialization=True)
    prompts = [f"copy: the {w} and the {w} and the {w} and the" for w in
               ("cat", "dog", "abc", "true", "null", "fish", "false", "tree")]

    accepted = []

    def run(spec: dict[str, Any] | None, stops: list[list[str]]) -> list[Any]:
        llm = LLM(str(directory), dtype="float32", device=TEST_DEVICE, check_integrity=True,
                  apply_process_settings=False, speculative_config=spec, num_kv_blocks=512)
        params = [SamplingParams(temperature=0.0, max_tokens=24, stop=s, ignore_eos=True)
                  for s in stops]
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats().spec_decoding
        accepted.append(stats.num_accepted_tokens if stats else 0)
        return outputs

    free = run(None, [[] for _ in prompts])
    # A stop string from the middle of each plain output (3 characters at its middle).
    stops = [[o.text[len(o.text) // 2 : len(o.text) // 2 + 3]] if len(o.text) > 6 else []
             for o in free]
    plain = run(None, stops)
    spec = run(NGRAM, stops)
    assert any(o.finish_reason == "stop" for o in plain)
    assert accepted[-1] > 0
    for a, b in zip(plain, spec, strict=True):
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
            (a.text, a.token_ids, a.finish_reason, a.stop_reason)


# ---- the server: --speculative-config and the spec_decode_* metrics ---------------------


def test_serve_with_speculative_config_exports_vllms_metrics(tmp_path: Path) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server_harness import start_server
    from tests.test_server_limits import stop_server

    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    server = start_server(tmp_path, "--speculative-config", config)
    try:
        text = "The quick brown fox jumps over the lazy dog near the quiet river bank."
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": f"Repeat the sentence.\nSentence: {text}\nRepeated: {text}\nSentence: {text}"
                      "\nRepeated:", "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        families = {f.name: f for f in text_string_to_metric_families(
            httpx.get(server.url + "/metrics", timeout=30).text)}
        values = {name: sum(s.value for s in families[f"tokenmill:{name}"].samples)
                  for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                               "spec_decode_num_accepted_tokens",
                               "spec_decode_num_accepted_tokens_per_pos")}
        assert values["spec_decode_num_drafts"] > 0
        assert 0 < values["spec_decode_num_accepted_tokens"] <= values["spec_decode_num_draft_tokens"]
        assert values["spec_decode_num_accepted_tokens_per_pos"] == \
            values["spec_decode_num_accepted_tokens"]
    finally:
        stop_server(server)


def test_serve_refuses_a_bad_speculative_config_naming_the_field() -> None:
    import os
    import subprocess
    import sys

    from tests.server_harness import REPO_ROOT

    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 0}'], capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    assert result.returncode != 0
    assert "num_speculative_tokens" in result.stderr


# ---- the draft-model proposer -----------------------------------------------------------


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A different tiny random model (another seed, one layer) with the same vocabulary."""
    import transformers

    from tests.hf_models import COMMON

    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    import torch

    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_hf_model(model, Path(tmp_path_factory.mktemp("draft")))


def test_draft_model_greedy_matches_transformers(target: dict[str, Any], other_draft: str) -> None:
    spec = {"method": "draft_model", "model": other_draft, "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    llm, outputs = run_greedy(target["path"], spec, **SCENARIOS["budget8-preempt"])
    assert_matches_oracle(llm, outputs, target["refs"])
    stats = llm.engine.stats().spec_decoding
    assert stats is not None and stats.num_draft_tokens > 0
    assert llm.engine.stats().num_preemptions > 0


def test_a_draft_model_equal_to_the_target_accepts_every_draft(target: dict[str, Any]) -> None:
    spec = {"method": "draft_model", "model": target["path"], "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    llm, outputs = run_greedy(target["path"], spec, num_kv_blocks=512, block_size=4)
    assert_matches_oracle(llm, outputs, target["refs"])
    stats = llm.engine.stats().spec_decoding
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # acceptance rate 1.0


# ---- bfloat16: the verification rows round as decoding one token a step does ----------------

# A model whose heads are 64 wide (the bf16 attention kernel's own paths, prefill
# tiles included, run at 32 / 64 / 128) with the default's narrow init, so that
# near-ties are common and a rounding difference flips a greedy choice. With the
# rows of a verification run as one prefill-like chunk (the code before issue 35's
# fix), 4 of these 8 prompts came out different on the C++ plan, 5 on the reference.
BF16_CONFIG: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "num_hidden_layers": 2,
                               "initializer_range": 0.02}


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch
    import transformers

    from tests.hf_models import COMMON

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**COMMON, **BF16_CONFIG}), dtype=torch.float32)
    return save_hf_model(model, Path(tmp_path_factory.mktemp("bf16-target")))


def bf16_prompts() -> list[list[int]]:
    rng = np.random.default_rng(35)
    prompts = []
    for _ in range(8):  # a passage and the start of its copy
        tokens = rng.integers(3, VOCAB_SIZE, size=96).tolist()
        prompts.append(tokens + tokens[:48])
    return prompts


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp-plan", "reference"])
def test_bf16_greedy_is_the_same_with_and_without_speculation(bf16_target: str, cpp: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens with n-gram speculation are plain greedy's, bit for bit, in
    bfloat16, on the C++ plan and on the reference model (torch attention):
    each verification row is a decode of its own, through the decode kernels."""
    from tokenmill.backends.cpu import kernels
    from tokenmill.backends.cpu.plan import CpuPlan

    prompts = [{"prompt_token_ids": p} for p in bf16_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    runs = []
    if not cpp:
        monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    for spec in (None, NGRAM):
        llm = LLM(bf16_target, dtype="bfloat16", device=TEST_DEVICE, skip_tokenizer_init=True,
                  apply_process_settings=False, speculative_config=spec)
        if TEST_DEVICE == "cpu":
            assert isinstance(llm.engine.runner.forward, CpuPlan) == (cpp and kernels.load() is not None)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    stats = llm.engine.stats().spec_decoding
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for i, (plain, spec_tokens) in enumerate(zip(*runs, strict=True)):
        assert spec_tokens == plain, f"prompt {i}"


def test_verification_rows_are_decodes_of_their_own() -> None:
    """The runner's metadata: a request with k drafts is k + 1 decode sequences over
    its block table row, contexts L + 1 .. L + k + 1, and the CPU plan's thread
    split keeps them together (row i reads the K/V row i - 1 writes)."""
    import torch

    from tokenmill.backends.cpu import dispatch
    from tokenmill.core.contracts import ScheduledRequest
    from tokenmill.core.kv_layout import one_group
    from tokenmill.worker.model_runner import ModelRunner

    def scheduled(rid: str, tokens: list[int], computed: int, blocks: list[int],
                  drafts: int = 0) -> ScheduledRequest:
        return ScheduledRequest(request_id=rid, token_ids=tokens, num_computed_tokens=computed,
                                block_ids=blocks, sampling_params=SamplingParams(), do_sample=True,
                                num_draft_tokens=drafts)

    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device = 4, torch.device("cpu")
    runner.layout, runner._layer_groups = one_group(1), None
    reqs = [scheduled("d", [5], 6, [3, 4]),  # a decode at position 6
            scheduled("s", [7, 8, 9], 9, [1, 2, 0], drafts=2),  # new token + 2 drafts at 9, 10, 11
            scheduled("p", [1, 2, 3], 0, [5])]  # a prefill chunk
    _, positions, meta, starts = runner._prepare_inputs(reqs)
    assert starts == [0, 1, 4, 7]
    assert positions.tolist() == [6, 9, 10, 11, 0, 1, 2]
    assert meta.num_decodes == 4 and meta.seq_req == [0, 1, 1, 1, 2]
    assert meta.query_start_loc == [0, 1, 2, 3, 4, 7]
    assert meta.seq_lens == [7, 10, 11, 12, 3]
    assert meta.decode_seq_lens.tolist() == [7, 10, 11, 12]
    assert meta.block_tables.tolist() == [[3, 4, 0], [1, 2, 0], [1, 2, 0], [1, 2, 0], [5, 0, 0]]
    assert meta.token_seq_ids is not None and meta.token_seq_ids.tolist() == [0, 1, 2, 3, 4, 4, 4]
    assert meta.slot_mapping.tolist() == [4 * 4 + 2, 0 * 4 + 1, 0 * 4 + 2, 0 * 4 + 3, 20, 21, 22]
    # Without drafts: a sequence per request, as before.
    _, _, plain, _ = runner._prepare_inputs([reqs[0], reqs[2]])
    assert plain.seq_req is None and plain.query_start_loc == [0, 1, 4] and plain.num_decodes == 1

    # 40 decode rows, requests of 5 rows (1 + 4 drafts) after one of 3: equal costs
    # would cut at row 20, inside the request of rows 18-22; the cut goes to row 23.
    split_meta = dataclasses.replace(meta, num_decodes=40, query_start_loc=list(range(41)),
                                     seq_lens=[300] * 40, seq_req=[(r + 2) // 5 for r in range(40)])
    assert dispatch.split_bounds(split_meta, 2, 460.0, 16) == [0, 23, 40]
    assert dispatch.split_bounds(dataclasses.replace(split_meta, seq_req=None), 2, 460.0, 16) == [0, 20, 40]
