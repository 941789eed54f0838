"""LoRA adapters against transformers + peft, batched with base requests.

A tiny random Llama with four PEFT adapters of different ranks, targets and
scalings (rsLoRA on one), their A and B random (PEFT starts B at zero, which
would test nothing). 32 prompts, each on the base model or one of the
adapters, run in one engine with max_loras=2 (the scheduler's limit is
checked every step) under the batching situations of test_correctness
(chunked prefill, forced preemption, prefix hits): greedy tokens equal peft's
and logprobs within 1e-4 in float32. Then Q8_0 weights (in float32, against
peft on the dequantized weights, the same 1e-4) and bfloat16 (prompt logprobs
against the float32 reference, within a bound well under the adapter's own
effect).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import peft
import pytest
import torch

from tests.hf_models import build_hf_model, hf_greedy, save_hf_model
from tests.test_correctness import MAX_TOKENS, PROMPTS
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.model.quantization import dequantize_q8_0, quantize_q8_0

# (rank, alpha, targets, rsLoRA)
ADAPTERS: list[tuple[int, int, list[str], bool]] = [
    (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    (8, 16, ["q_proj", "v_proj"], True),
    (16, 32, ["gate_proj", "up_proj", "down_proj"], False),
    (2, 4, ["k_proj", "o_proj", "down_proj"], False),
]
NUM_LORAS = len(ADAPTERS)


def lora_of(i: int) -> int:
    """Prompt i's adapter id (0: the base model)."""
    return i % (NUM_LORAS + 1)


def make_peft(base: torch.nn.Module, k: int) -> Any:
    """Adapter k on a copy of `base`, A and B random (seeded by k)."""
    rank, alpha, targets, rslora = ADAPTERS[k]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             lora_dropout=0.0, bias="none")
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(100 + k)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.eval()
    return model


def q8_0_dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every Linear's and the embedding's weight replaced by its
    Q8_0 blocks dequantized: what tokenmill's q8_0 computes on in float32."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                module.weight.copy_(dequantize_q8_0(*quantize_q8_0(module.weight)))
    return model


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = Path(tmp_path_factory.mktemp("lora"))
    base = build_hf_model("llama")
    path = save_hf_model(base, root / "base")
    loras, refs, q8_refs = [], {}, {}
    peft_models = []
    for k in range(NUM_LORAS):
        model = make_peft(base, k)
        model.save_pretrained(root / f"adapter{k}")
        loras.append(LoRARequest(f"adapter{k}", k + 1, str(root / f"adapter{k}")))
        peft_models.append(model)
    q8_base = q8_0_dequantized(base)
    q8_models = [peft.PeftModel.from_pretrained(copy.deepcopy(q8_base), root / f"adapter{k}").eval()
                 for k in range(NUM_LORAS)]
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        lora = lora_of(i)
        refs[i] = hf_greedy(base if lora == 0 else peft_models[lora - 1], prompt, n)
        q8_refs[i] = hf_greedy(q8_base if lora == 0 else q8_models[lora - 1], prompt, n)
    return {"path": path, "loras": loras, "refs": refs, "q8_refs": q8_refs, "base": base,
            "peft": peft_models}


def test_the_adapters_change_the_output(case: dict[str, Any]) -> None:
    """Each adapter's greedy tokens differ from the base model's somewhere (else
    the comparisons below would not see a lost delta)."""
    base = build_hf_model("llama")
    for k in range(NUM_LORAS):
        changed = [i for i in range(len(PROMPTS)) if lora_of(i) == k + 1
                   and case["refs"][i][0] != hf_greedy(base, PROMPTS[i], MAX_TOKENS[i])[0]]
        assert changed, f"adapter {k} changes no prompt's greedy tokens"


SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {"num_kv_blocks": 512},
    "budget8": {"max_num_batched_tokens": 8, "num_kv_blocks": 512},
    "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 64},
    "prefix": {"block_size": 4, "num_kv_blocks": 1024},
}


def run_mixed(case: dict[str, Any], refs_key: str, path: str | None = None, **engine: Any) -> LLM:
    """All prompts in one generate call, each on its adapter (or none); greedy
    tokens equal the reference's and logprobs within 1e-4; at most max_loras
    adapters in any step."""
    llm = LLM(path or case["path"], dtype="float32", skip_tokenizer_init=True, check_integrity=True,
              enable_lora=True, max_loras=2, max_cpu_loras=NUM_LORAS, **engine)
    runner = llm.engine.runner
    execute = runner.execute
    adapters_per_step: list[int] = []

    def watched(out: Any) -> Any:
        adapters_per_step.append(len({r.lora_int_id for r in out.scheduled} - {0}))
        return execute(out)

    runner.execute = watched  # type: ignore[method-assign,assignment]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in MAX_TOKENS]
    loras = [None if lora_of(i) == 0 else case["loras"][lora_of(i) - 1] for i in range(len(PROMPTS))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           lora_request=loras)
    for i, out in enumerate(outputs):
        ref_tokens, ref_logprobs = case[refs_key][i]
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i} (adapter {lora_of(i)})"
        assert completion.logprobs is not None
        ours = [entry[t].logprob for entry, t in zip(completion.logprobs, ref_tokens, strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
    assert max(adapters_per_step) == 2, adapters_per_step  # the limit, reached and kept
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
    return llm


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_peft(case: dict[str, Any], scenario: str) -> None:
    llm = run_mixed(case, "refs", **SCENARIOS[scenario])
    scheduler = llm.engine.scheduler
    if scenario == "preempt":
        assert scheduler.num_preemptions > 0
    if scenario == "prefix":
        assert scheduler.prefix_cache_hits > 0


def test_q8_0_matches_peft_on_the_dequantized_weights(case: dict[str, Any]) -> None:
    """Q8_0 base weights: the delta is added to the quantized projection's
    output; in float32 that is the dequantized weights exactly, so the bound
    is float32's 1e-4."""
    run_mixed(case, "q8_refs", quantization="q8_0", num_kv_blocks=512, max_num_batched_tokens=16)


def test_gguf_blocks_match_peft_on_the_dequantized_weights(
        case: dict[str, Any], tmp_path: Path) -> None:
    """A GGUF file's own Q4_1 / Q4_0 / Q8_0 blocks (quantization="gguf"): in
    float32 the plan computes on the values gguf-py dequantizes, so peft on
    those values is the reference, within 1e-4."""
    from tests.test_quantization_gguf import Q4_0, Q8_0, _dequantize_into, _write_gguf

    base = build_hf_model("llama")
    path = tmp_path / "tiny.gguf"
    written = _write_gguf(base, path, {"attn_k": Q4_0, "ffn_down": Q8_0})
    _dequantize_into(base, written)
    refs = {}
    for k in range(NUM_LORAS):
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), case["loras"][k].lora_path).eval()
        for i in range(len(PROMPTS)):
            if lora_of(i) == k + 1:
                refs[i] = hf_greedy(model, PROMPTS[i], MAX_TOKENS[i])
    for i in range(len(PROMPTS)):
        if lora_of(i) == 0:
            refs[i] = hf_greedy(base, PROMPTS[i], MAX_TOKENS[i])
    llm = run_mixed({**case, "gguf_refs": refs}, "gguf_refs", str(path), quantization="gguf",
                    num_kv_blocks=512, max_num_batched_tokens=16)
    assert "gguf" in str(llm.engine.model_config.quantization)


# bfloat16 against the float32 reference: the largest prompt-logprob error
# allowed, and the least part of the adapter's own effect it may be.
BF16_MAX_ERROR = 0.15
BF16_MAX_ERROR_OF_EFFECT = 0.25


@torch.inference_mode()
def _prompt_logprobs(model: Any, prompt: list[int]) -> np.ndarray:
    logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return np.asarray(torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0])


def test_bfloat16_within_bound_of_the_float32_reference(case: dict[str, Any]) -> None:
    llm = LLM(case["path"], dtype="bfloat16", skip_tokenizer_init=True, enable_lora=True,
              max_loras=2, max_cpu_loras=NUM_LORAS, num_kv_blocks=512)
    prompts = [p for p in PROMPTS if len(p) >= 16][: 2 * NUM_LORAS]
    loras = [case["loras"][i % NUM_LORAS] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=loras)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert out.prompt_logprobs is not None
        ours = np.array([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:],
                                                                strict=True) if entry is not None])
        ref = _prompt_logprobs(case["peft"][i % NUM_LORAS], prompt)
        base = _prompt_logprobs(case["base"], prompt)
        error, effect = np.abs(ours - ref).max(), np.abs(ref - base).max()
        assert error < BF16_MAX_ERROR, (i, error)
        assert error < BF16_MAX_ERROR_OF_EFFECT * effect, (i, error, effect)


def test_speculative_decoding_with_adapters(case: dict[str, Any]) -> None:
    """n-gram drafts are verified on the request's adapter: the same greedy
    tokens as peft's, and drafts were accepted."""
    llm = run_mixed(case, "refs", num_kv_blocks=512, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    spec = llm.engine.scheduler.stats().spec_decoding
    assert spec is not None and spec.num_accepted_tokens > 0, spec


def test_base_rows_keep_their_bits_beside_adapter_rows(case: dict[str, Any]) -> None:
    """bf16: base requests give the same tokens and logprobs alone and in steps
    with adapter rows (their deltas added between the same kernels)."""
    llm = LLM(case["path"], dtype="bfloat16", skip_tokenizer_init=True, enable_lora=True,
              max_loras=NUM_LORAS, max_cpu_loras=NUM_LORAS, num_kv_blocks=512,
              enable_prefix_caching=False)
    base = [i for i in range(len(PROMPTS)) if lora_of(i) == 0]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True, logprobs=0)
              for i in range(len(PROMPTS))]
    alone = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in base], [params[i] for i in base],
                         use_tqdm=False)
    loras = [None if lora_of(i) == 0 else case["loras"][lora_of(i) - 1] for i in range(len(PROMPTS))]
    mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                         lora_request=loras)
    for k, i in enumerate(base):
        ours, theirs = mixed[i].outputs[0], alone[k].outputs[0]
        assert ours.token_ids == theirs.token_ids, f"prompt {i}"
        assert ours.logprobs is not None and theirs.logprobs is not None
        assert [e[t].logprob for e, t in zip(ours.logprobs, ours.token_ids, strict=True)] == [
            e[t].logprob for e, t in zip(theirs.logprobs, theirs.token_ids, strict=True)], f"prompt {i}"


def test_adapter_rows_give_the_same_bits_on_the_layer_loop_and_the_python_loop(
        case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: the plan's C++ paths and its Python loop add the deltas with one
    kernel (csrc lora_delta): every request's tokens and logprobs, base and
    adapter rows, equal on the plan's LOOP, with its decodes on SPLIT (each
    thread its own rows; forced on every decode-only step here), and on its
    Python loop (the profiler forces it)."""
    from torch.profiler import ProfilerActivity, profile

    from tokenmill.backends.cpu import plan as plan_module
    from tokenmill.backends.cpu.dispatch import Path as Route

    llm = LLM(case["path"], dtype="bfloat16", skip_tokenizer_init=True, enable_lora=True,
              max_loras=NUM_LORAS, max_cpu_loras=NUM_LORAS, num_kv_blocks=512, enable_prefix_caching=False)
    if not isinstance(llm.engine.runner.forward, plan_module.CpuPlan):
        pytest.skip("the C++ kernels are not built here")
    routes: list[Route] = []
    choose = plan_module.choose_path

    def recorded(meta: Any, facts: Any, **kwargs: Any) -> Any:
        # (any two rows a thread may split: this case's steps are small)
        route = choose(meta, dataclasses.replace(facts, split_min_rows=1, split_max_share=1.0), **kwargs)
        if kwargs["lora"]:
            routes.append(route.path)
        return route

    monkeypatch.setattr(plan_module, "choose_path", recorded)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    loras = [None if lora_of(i) == 0 else case["loras"][lora_of(i) - 1] for i in range(len(PROMPTS))]

    def run() -> list[tuple[list[int], list[float]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                            lora_request=loras)
        return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs or [],
                                                                         o.outputs[0].token_ids, strict=True)])
                for o in outs]

    looped = run()
    assert {Route.LOOP, Route.SPLIT} <= set(routes), set(routes)
    routes.clear()
    with profile(activities=[ProfilerActivity.CPU]):
        python = run()
    assert routes and set(routes) == {Route.PYTHON}, set(routes)
    assert looped == python
