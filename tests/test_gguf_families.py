"""GGUF files of every family tokenmill runs, dispatched on `general.architecture`
(model/gguf_families.py), and the tokenizer's pre-tokenizer by `tokenizer.ggml.pre`.

A tiny random Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorms, head_dim
32 != hidden / heads) are written as llama.cpp's converter writes them (its
tensor names and `{arch}.` keys; no Q/K row permutation, which it does for
llama only) and must give the Hugging Face model's greedy tokens, logprobs
within 1e-4 in float32, on the C++ plan and the reference path, under chunked
prefill and preemption; with Q8_0 matrices and quantization="gguf", those of
transformers on the dequantized values. A tiny Gemma 3 (q/k norms, a window
of 8 on its first layer, a global second with its own RoPE base) and Gemma 2
(soft-caps) likewise, their norms stored as 1 + w and llama.cpp's names for
the four norms, on the plan and the reference.
A tiny Phi-3 (a window of 16) and Phi-4-mini (3/4 of each head rotated,
LongRoPE, a tied head) are written as `phi3` files: the fused attn_qkv and
ffn_up (gate and up rows) kept fused, the LongRoPE factors as the tensors
rope_factors_short / rope_factors_long with the attention factor in the
metadata, and run on the plan and the reference.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import pre_tokenizers

from tests.hf_models import (
    TEST_DEVICE,
    add_phi3_rope_factors,
    build_hf_model,
    finish_gguf,
    gguf_tensors,
    gguf_writer,
    hf_greedy,
    save_hf_model,
)
from tests.test_quantization import MAX_TOKENS, PROMPTS, SCENARIOS
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.plan import CpuPlan
from tokenmill.config import ModelConfig
from tokenmill.model.gguf_families import GGUF_FAMILIES
from tokenmill.model.loader import load_model
from tokenmill.model.source import resolve_model_source
from tokenmill.tokenizer import GGUF_PRE_TOKENIZERS, Tokenizer, gguf_pre_tokenizer

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the plan and quantization run on the CPU")

FAMILIES = ["qwen2", "qwen3", "gemma3", "gemma2", "phi3", "phi4-mini", "qwen3-moe", "mixtral", "gpt-oss"]
# The `general.architecture` of a family's file where it is not the family's name.
GGUF_ARCH = {"phi4-mini": "phi3", "qwen3-moe": "qwen3moe", "mixtral": "llama"}
MXFP4 = gguf.GGMLQuantizationType.MXFP4
# What a Gemma GGUF cannot say takes llama.cpp's value: the query scale is the
# head size's (query_pre_attn_scalar = head_dim), the layers slide but every
# n-th (the file says n = 2: a tiny model's [sliding, global]).
GEMMA_GGUF = {"query_pre_attn_scalar": 32}
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _write_gguf(hf_model: Any, path: Path, arch: str, quantized: bool = False) -> None:
    """hf_model as llama.cpp writes an `arch` file: float32 tensors, or (quantized)
    every matrix as Q8_0 (gpt-oss's experts as MXFP4, as its files hold them),
    hf_model's matrices then set to the dequantized values so that it stays the
    exact oracle."""
    writer = gguf_writer(hf_model, path, GGUF_ARCH.get(arch, arch))
    writer.add_tokenizer_pre("qwen2")
    if arch.startswith("gemma"):
        writer.add_sliding_window_pattern(2)
    if arch == "qwen3-moe":
        writer.add_expert_weights_norm(hf_model.config.norm_topk_prob)
    add_phi3_rope_factors(hf_model, writer)
    with torch.no_grad():
        for gguf_name, part, heads, weight, param in gguf_tensors(hf_model):
            if heads is not None:  # (llama.cpp permutes Q/K for its llama files only: Mixtral's)
                assert arch == "mixtral"
            # (llama.cpp keeps routers, biases and sinks F32)
            if not quantized or weight.ndim == 1 or part in ("ffn_gate_inp", "attn_sinks") or (
                    gguf_name.endswith(".bias")):
                writer.add_tensor(gguf_name, weight)
                continue
            kind = MXFP4 if arch == "gpt-oss" and part.endswith("_exps") else Q8_0  # (gpt-oss's experts: MXFP4)
            data = gguf.quants.quantize(weight, kind)
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
            values = np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32).reshape(weight.shape)
            if heads is not None:  # back to HF's row order (rows permute whole Q8_0 blocks)
                values = values.reshape(heads, -1, 2, values.shape[-1]).swapaxes(1, 2).reshape(weight.shape)
            param.copy_(torch.from_numpy(values))
    finish_gguf(writer)


@pytest.fixture(scope="module", params=[(f, q) for f in FAMILIES for q in (False, True)],
                ids=[f"{f}-{'q8_0' if q else 'f32'}" for f in FAMILIES for q in (False, True)])
def family_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch, quantized = request.param
    hf_model = build_hf_model(arch, **(GEMMA_GGUF if arch.startswith("gemma") else {}))
    path = tmp_path_factory.mktemp(arch) / "tiny.gguf"
    _write_gguf(hf_model, path, arch, quantized)
    refs = [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    return {"arch": arch, "quantized": quantized, "path": str(path), "refs": refs, "hf_model": hf_model}


def test_the_file_loads_as_its_family(family_case: dict[str, Any]) -> None:
    arch, hf_model = family_case["arch"], family_case["hf_model"]
    _, spec = load_model(ModelConfig(dtype="float32"), resolve_model_source(family_case["path"]))
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # (a llama file with experts is Mixtral)
    assert spec.architecture == type(hf_model).__name__
    assert spec.architecture == GGUF_FAMILIES[GGUF_ARCH.get(arch, arch)].architecture or arch == "mixtral"
    assert (spec.attention_bias, spec.qk_norm) == (arch in ("qwen2", "gpt-oss"), arch in ("qwen3", "gemma3", "qwen3-moe"))
    if arch in ("qwen3-moe", "mixtral", "gpt-oss"):  # the file says what the directory says
        with tempfile.TemporaryDirectory() as directory:
            _, hf_spec = load_model(ModelConfig(dtype="float32"),
                                    resolve_model_source(save_hf_model(hf_model, Path(directory))))
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        assert [getattr(spec, f) for f in moe] == [getattr(hf_spec, f) for f in moe]
        # (llama.cpp's graphs renormalise: the tiny Qwen3-MoE that does not is told by the test's file)
        assert spec.norm_topk_prob == hf_spec.norm_topk_prob or arch == "gpt-oss"  # (its router has no such rule)
        gpt = ("moe_bias", "moe_topk_then_softmax", "attention_sinks", "swiglu_limit", "layer_types",
               "sliding_window", "rope_scaling", "norm_in_float32")
        assert [getattr(spec, f) for f in gpt] == [getattr(hf_spec, f) for f in gpt]
    if arch.startswith("gemma"):
        assert spec.layer_types == tuple(cfg.layer_types) and spec.sliding_window == cfg.sliding_window
        assert spec.query_pre_attn_scalar == cfg.query_pre_attn_scalar
        assert (spec.attn_logit_softcapping, spec.final_logit_softcapping) == (
            cfg.attn_logit_softcapping, cfg.final_logit_softcapping)
        assert spec.local_rope_theta == (1e4 if arch == "gemma3" else None)
    if arch.startswith("phi"):  # the file says what the directory says
        with tempfile.TemporaryDirectory() as directory:
            _, hf_spec = load_model(ModelConfig(dtype="float32"),
                                    resolve_model_source(save_hf_model(hf_model, Path(directory))))
        assert (spec.rotary_dim, spec.sliding_window) == (hf_spec.rotary_dim, hf_spec.sliding_window)
        assert spec.tie_word_embeddings == hf_spec.tie_word_embeddings
        assert spec.rope_scaling is not None or hf_spec.rope_scaling is None
        if spec.rope_scaling is not None:  # (the file's factors are float32, as transformers computes with)
            assert hf_spec.rope_scaling is not None
            for key in ("short_factor", "long_factor"):
                assert np.array_equal(np.float32(spec.rope_scaling[key]), np.float32(hf_spec.rope_scaling[key]))
            assert spec.rope_scaling["original_max_position_embeddings"] == cfg.original_max_position_embeddings
            assert np.float32(spec.rope_scaling["attention_factor"]) == np.float32(
                hf_spec.rope_scaling["attention_factor"])
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (
        cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)


@pytest.mark.parametrize("cpp", [True, False], ids=["plan", "reference"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(family_case: dict[str, Any], scenario: str, cpp: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: transformers' greedy tokens and logprobs within 1e-4, on the plan
    and the reference, under chunked prefill (budget8) and preemption; Q8_0
    matrices served as the file's own blocks (quantization="gguf")."""
    if cpp and kernels.load() is None:
        pytest.skip("no C++ kernels on this machine")
    if not cpp:
        monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    # (MXFP4 is not a format tokenmill keeps: "gguf" would quantize gpt-oss's experts again, as Q8_0;
    # dequantized at load they are the oracle's values exactly)
    quantization = ("gguf" if family_case["arch"] != "gpt-oss" else "none") if family_case["quantized"] else None
    llm = LLM(family_case["path"], dtype="float32", quantization=quantization, device="cpu",
              skip_tokenizer_init=True, check_integrity=True, **SCENARIOS[scenario])
    forward = llm.engine.runner.forward
    assert isinstance(forward, CpuPlan) == cpp
    if isinstance(forward, CpuPlan) and quantization == "gguf":
        formats_here = forward.ops.weight_formats()
        # (each expert's down too; a router stays float, as llama.cpp writes it)
        downs = [d for layer in forward.layers for d in (layer.experts.down if layer.experts else [layer.down])]
        assert all(d is not None and formats_here[d.format] == "q8_0" for d in downs)
        assert all(formats_here[layer.experts.router.format] == "float32" for layer in forward.layers if layer.experts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, family_case["refs"], strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}"
        assert completion.logprobs is not None
        ours = [entry[tok].logprob for entry, tok in zip(completion.logprobs, ref_tokens, strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
    if scenario == "preempt":
        assert llm.engine.stats().num_preemptions > 0


def test_q_and_k_rows_are_as_the_file_has_them(tmp_path: Path) -> None:
    """The un-permute is the llama row's alone: llama.cpp's converter leaves a
    Qwen2's Q/K rows (and biases) in Hugging Face's order, and so does the loader."""
    hf_model = build_hf_model("qwen2")
    path = tmp_path / "q.gguf"
    _write_gguf(hf_model, path, "qwen2")
    model, _ = load_model(ModelConfig(dtype="float32"), resolve_model_source(str(path)))
    qkv = model.model.layers[0].self_attn.qkv_proj
    hf_attn = hf_model.model.layers[0].self_attn
    assert torch.equal(qkv.weight[qkv.shard_slice("k")], hf_attn.k_proj.weight)
    assert torch.equal(qkv.bias[qkv.shard_slice("q")], hf_attn.q_proj.bias)


# --- the tokenizer's pre-tokenizer, by tokenizer.ggml.pre ------------------------------

# How llama.cpp splits "(hi 12345" (llama-vocab.cpp's regexes), per name: the gpt2
# regex; digits one by one, then gpt2's; llama3's (digits in threes, punctuation
# joined to a word); qwen2's (as llama3 but digits one by one).
SPLITS = {
    "gpt-2": ["(", "hi", "Ġ12345"],
    "smollm": ["(", "hi", "Ġ", "1", "2", "3", "4", "5"],
    "llama-bpe": ["(hi", "Ġ", "123", "45"],
    "qwen2": ["(hi", "Ġ", "1", "2", "3", "4", "5"],
    "gpt-4o": ["(hi", "Ġ", "123", "45"],
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_pre_tokenizer_by_name(name: str) -> None:
    pre = gguf_pre_tokenizer("m.gguf", name)
    assert [piece for piece, _ in pre.pre_tokenize_str("(hi 12345")] == SPLITS[name]
    assert set(SPLITS) <= set(GGUF_PRE_TOKENIZERS)


def test_gpt_4o_splits_words_by_case_and_keeps_contractions() -> None:
    """o200k_base's rules, which llama.cpp's gpt-4o split follows: a capital run
    starts a word, a lower-case run ends one, a contraction stays on its word,
    a slash run joins the punctuation before it; llama3's split differs on each."""
    def split(name: str, text: str) -> list[str]:
        pre = gguf_pre_tokenizer("m.gguf", name)
        return [piece for piece, _ in pre.pre_tokenize_str(text)]

    text = "HelloWorld I'M the HTTPServer's //path"
    assert split("gpt-4o", text) == ["Hello", "World", "ĠI'M", "Ġthe", "ĠHTTPServer's", "Ġ//",
                                     "path"]
    assert split("llama-bpe", text) == ["HelloWorld", "ĠI", "'M", "Ġthe", "ĠHTTPServer", "'s",
                                        "Ġ//", "path"]


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf_writer(build_hf_model("qwen2"), path, "qwen2")
    writer.add_tokenizer_pre("mystery-bpe")
    finish_gguf(writer)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre='mystery-bpe' is not a supported") as info:
        Tokenizer.load(str(path))
    assert str(path) in str(info.value)


def test_default_model_splits_digits_as_smollm_does() -> None:
    """The default file's tokenizer.ggml.pre is "smollm": every digit is its own
    token, as in SmolLM2's own tokenizer.json (Digits(individual_digits) first)."""
    tokenizer = Tokenizer.load(resolve_model_source(None).path)
    ids = tokenizer.encode("In 2024, 1234567 people", add_special_tokens=False)
    pieces = [tokenizer.hf.convert_ids_to_tokens(i) for i in ids]
    digits = [p.lstrip("Ġ") for p in pieces if any(c.isdigit() for c in p)]
    assert "".join(digits) == "20241234567" and all(len(d) == 1 for d in digits)
    assert tokenizer.decode(ids) == "In 2024, 1234567 people"


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (the 256 byte symbols, then merged tokens) and
    its merges, learned greedily on a little text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens = ["<|endoftext|>", *symbols]
    merges: list[str] = []
    text = ["the", "then", "there", "123", "1234", "(hi", "hi's", "I'M", "hello", "world", "2024", "(the"]
    words = [[bytes_to_unicode()[b] for b in w.encode()] for w in text]
    words += [["Ġ", *w] for w in words]
    for _ in range(40):
        pairs: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in itertools.pairwise(w):
                pairs[a, b] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        a, b = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i:i + 2] = [a + b]
                i += 1
    return tokens, merges


def test_qwen2_file_tokenizes_as_transformers_qwen2_tokenizer(tmp_path: Path) -> None:
    """A byte-level BPE file with tokenizer.ggml.pre "qwen2" encodes as transformers'
    Qwen2Tokenizer on the same vocabulary and merges (ASCII text: Qwen2's NFC
    normalizer changes nothing)."""
    tokens, merges = _byte_level_vocab()
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    finish_gguf(writer)
    ours = Tokenizer.load(str(path))
    oracle = transformers.Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=[tuple(m.split(" ")) for m in merges])
    texts = ["the then there", "(hi 12345 (the", "I'M hi's there's", "  hello\n\n world  ",
             "2024-01-02: 1234567", "x=(a+b)*c; // the end", "\ttabs\tand  spaces ", ""]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == oracle.encode(text, add_special_tokens=False), text
    assert isinstance(ours.hf.backend_tokenizer.pre_tokenizer, pre_tokenizers.Sequence)
