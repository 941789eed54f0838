"""Greedy tokens in bfloat16 do not depend on the load (issue 51).

A tiny random Llama in bf16 (head_dim 64, small init, so near-ties are common),
32 prompts that share a 40-token prefix: greedy tokens are the same bits when
each prompt runs alone, all together, in a KV pool so small that most requests
are preempted (and recomputed), under chunk budgets of 7, 16 and 61 tokens,
after a prefix-cache hit, and with n-gram speculation; on the C++ plan and on
the reference forward (kernels off), in every weight format: bf16, q8_0, and a
GGUF file's own blocks (k-quants and the 32-value formats mixed); and a tiny
Qwen3-MoE in bf16 (8 experts, top 2: each step's rows share experts differently),
a Gemma 3 (q/k norms, a window, a second RoPE base, (1 + w) norms, GeGLU) and
a Gemma 2 (soft-capped scores and logits) in bf16.

The opt-out (TOKENMILL_BATCH_INVARIANT=0) is shown to matter where it changes
the arithmetic on this CPU: the reference path's tokens then move with the load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import transformers

from tests.hf_models import COMMON, TEST_DEVICE, VOCAB_SIZE, save_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.plan import CpuPlan

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the formats and the plan run on the CPU")

NUM_PROMPTS = 32
PREFIX_TOKENS = 40
# Inputs a multiple of 256 (the k-quants' super-blocks), head_dim 64 (the bf16
# kernels' prefill tiles), init 0.02: logits close together, so a rounding
# difference anywhere shows as a flipped greedy token within a few dozen steps.
CONFIG: dict[str, Any] = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "num_hidden_layers": 2, "initializer_range": 0.02}
NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3, "disable_by_batch_size": 64}


def make_prompts() -> tuple[list[int], list[list[int]], list[int]]:
    """The shared prefix, the prompts (prefix + their own tail; every other one
    repeats a stretch of itself, prompt lookup's case) and each one's max_tokens."""
    rng = np.random.default_rng(51)
    prefix = rng.integers(3, VOCAB_SIZE, size=PREFIX_TOKENS).tolist()
    prompts = []
    for i in range(NUM_PROMPTS):
        tail = rng.integers(3, VOCAB_SIZE, size=int(rng.integers(1, 50))).tolist()
        if i % 2:
            tail = tail + tail[: max(1, len(tail) // 2)]
        prompts.append(prefix + tail)
    max_tokens = rng.integers(24, 64, size=NUM_PROMPTS).tolist()
    return prefix, prompts, max_tokens


PREFIX, PROMPTS, MAX_TOKENS = make_prompts()

# Each scenario: the engine's options, all 32 prompts in one generate call.
# Prefix caching is off but where it is the scenario (a hit changes where a
# prompt's computation starts, which is that scenario's own question).
SCENARIOS: dict[str, dict[str, Any]] = {
    "together": {},
    # 48 blocks of 4 tokens for 32 requests of up to 179 tokens: most are preempted.
    "preempted": {"num_kv_blocks": 48, "block_size": 4},
    "budget7": {"max_num_batched_tokens": 7},
    "budget16": {"max_num_batched_tokens": 16},
    "budget61": {"max_num_batched_tokens": 61},
    "prefix-hit": {"enable_prefix_caching": True},
    "ngram": {"speculative_config": NGRAM},
}
# Windowed layers give blocks back (core/kv_hybrid.py): under pressure with less
# memory and 32-token chunks (the window's blocks held at once grow with a chunk).
WINDOWED_SCENARIOS = {"preempted": {"num_kv_blocks": 30, "block_size": 4, "max_num_batched_tokens": 32}}


def _gguf_file(hf_model: Any, directory: Path) -> str:
    from tests.test_quantization_kquants import LAYOUTS, _write_gguf

    path = directory / "tiny.gguf"
    _write_gguf(hf_model, path, LAYOUTS["mixed"])  # Q4_K, Q5_K, Q6_K, Q4_0, Q5_0 and Q8_0
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per weight format: the checkpoint and LLM's options."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG),
                                                             dtype=torch.float32).eval()
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp("bf16"))
    moe = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        **CONFIG, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        norm_topk_prob=True), dtype=torch.float32).eval()
    gemma: dict[str, Any] = {**CONFIG, "head_dim": 64, "sliding_window": 16}
    gemma3 = transformers.Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention"])
    gemma2 = transformers.Gemma2Config(**gemma, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    gpt_oss = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(
        **CONFIG, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"]), dtype=torch.float32).eval()
    with torch.no_grad():  # (sinks and biases start at zero: spread them, so they count)
        for name, param in gpt_oss.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.normal_(0.0, 0.5)
    return {
        "gpt-oss": {"model": save_hf_model(gpt_oss, tmp_path_factory.mktemp("gpt-oss"))},
        "moe": {"model": save_hf_model(moe, tmp_path_factory.mktemp("moe"))},
        "bf16": {"model": directory},
        "q8_0": {"model": directory, "quantization": "q8_0"},
        "gguf": {"model": _gguf_file(hf_model, tmp_path_factory.mktemp("gguf")), "quantization": "gguf"},
        **{name: {"model": save_hf_model(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(),
                                         tmp_path_factory.mktemp(name))}
           for name, cfg in (("gemma3", gemma3), ("gemma2", gemma2))},
    }


def _llm(model: dict[str, Any], cpp: bool, invariant: bool = True, **options: Any) -> LLM:
    """`cpp` False: the reference forward (the environment's switch, read as the engine starts)."""
    # A pool of 512 blocks unless the scenario says (check_integrity walks the pool every step).
    options = {"enable_prefix_caching": False, "num_kv_blocks": 512, **options}
    switches = {"TOKENMILL_NO_CPP_KERNELS": "0" if cpp else "1", "TOKENMILL_BATCH_INVARIANT": str(int(invariant))}
    with mock.patch.dict(os.environ, switches):
        llm = LLM(model["model"], dtype="bfloat16", quantization=model.get("quantization"), device="cpu",
                  skip_tokenizer_init=True, apply_process_settings=False, check_integrity=True, **options)
    assert isinstance(llm.engine.runner.forward, CpuPlan) == (cpp and kernels.load() is not None)
    return llm


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


_ALONE: dict[tuple[str, bool], list[list[int]]] = {}


def _alone(models: dict[str, dict[str, Any]], fmt: str, cpp: bool) -> list[list[int]]:
    """Each prompt run by itself, in its own generate call: the tokens the others must give."""
    if (fmt, cpp) not in _ALONE:
        llm = _llm(models[fmt], cpp)
        _ALONE[fmt, cpp] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                            for p, params in zip(PROMPTS, _params(), strict=True)]
    return _ALONE[fmt, cpp]


# The families beside the Llama layer run every scenario on the plan; on the
# reference (the slow path, whose invariance is its linears' and attention's,
# the same code for every family) the two that recompute and chunk the most.
_FAMILIES = ("moe", "gemma3", "gemma2", "gpt-oss")
_CASES = [(cpp, fmt, scenario) for cpp in (True, False) for fmt in ("bf16", "q8_0", "gguf", *_FAMILIES)
          for scenario in SCENARIOS
          if cpp or fmt not in _FAMILIES or scenario in ("preempted", "budget7")]


@pytest.mark.parametrize(("cpp", "fmt", "scenario"), _CASES,
                         ids=[f"{'plan' if c else 'reference'}-{f}-{s}" for c, f, s in _CASES])
def test_greedy_tokens_do_not_depend_on_the_load(models: dict[str, dict[str, Any]], fmt: str,
                                                 scenario: str, cpp: bool) -> None:
    if cpp and kernels.load() is None:
        pytest.skip("no C++ kernels on this machine")
    alone = _alone(models, fmt, cpp)
    options = WINDOWED_SCENARIOS.get(scenario, SCENARIOS[scenario]) if fmt in ("gemma3", "gemma2", "gpt-oss") else \
        SCENARIOS[scenario]
    llm = _llm(models[fmt], cpp, **options)
    if scenario == "prefix-hit":  # the shared prefix computed once, its blocks cached
        llm.generate([{"prompt_token_ids": PREFIX}], SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    if scenario == "preempted":
        preempted = sum(1 for o in outputs if o.metrics is not None and o.metrics.num_preemptions > 0)
        assert preempted > NUM_PROMPTS // 2, f"only {preempted} of {NUM_PROMPTS} requests were preempted"
    if scenario == "prefix-hit":
        block_size = llm.engine.facts.cache.block_size
        assert all(o.num_cached_tokens == PREFIX_TOKENS // block_size * block_size for o in outputs)
    if scenario == "ngram":
        stats = llm.engine.stats().spec_decoding
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for o in outputs:
        assert o.error is None, o.error
    differ = [i for i, (o, ref) in enumerate(zip(outputs, alone, strict=True)) if o.outputs[0].token_ids != ref]
    assert not differ, f"{len(differ)} of {NUM_PROMPTS} prompts' greedy tokens differ from their run alone: {differ}"


@pytest.mark.parametrize("cpp", [True, False], ids=["plan", "reference"])
def test_the_opt_out_reaches_every_path(models: dict[str, dict[str, Any]], cpp: bool) -> None:
    """TOKENMILL_BATCH_INVARIANT=0 reaches what it switches (CpuBackendOptions.batch_invariant):
    the reference model's linears and attention, the plan's attention kernel calls."""
    if cpp and kernels.load() is None:
        pytest.skip("no C++ kernels on this machine")
    from tokenmill.model.llama import Linear, LlamaForCausalLM

    for invariant in (True, False):
        forward = _llm(models["bf16"], cpp, invariant=invariant).engine.runner.forward
        if isinstance(forward, CpuPlan):
            assert forward.attention.batch_invariant == invariant
            assert forward.weights.prefill_tiles != invariant
        else:
            assert isinstance(forward, LlamaForCausalLM)
            linears = [m for m in forward.modules() if isinstance(m, Linear)]
            assert linears and all(m.batch_invariant == invariant for m in linears)
            assert forward.model.layers[0].self_attn.backend.batch_invariant == invariant
