"""quantization="gguf" on GGUF's Q4_0, Q5_0, Q4_K, Q5_K and Q6_K blocks: kept as the
file has them (model/quantization.py), repacked at load (formats.pack_kquant) for
csrc/kq_gemm.cpp.

The oracle is gguf-py's dequantization (gguf.quants.dequantize) and transformers on
those values. gguf-py quantizes Q4_0 and Q5_0 but not the k-quants, so k-quant
blocks are built by one rule (`_random_blocks`): random bytes, then each float16
d (and dmin) overwritten by a value drawn uniformly from a range that keeps the
weights near the tiny models' scale; every byte pattern of the integer fields is
a valid block. Tolerances: float32 activations give the dequantized weights to the
bit (1e-4, equal greedy tokens); bf16 activations are quantized to int8 per
super-block (32 values, or 256 for the k-quants as llama.cpp's Q8_K), bounded per
output by sum_k |w_k| s_k / 2 with s the block's max|x| / 127.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.hf_models import COMMON, TEST_DEVICE, finish_gguf, gguf_tensors, gguf_writer, hf_greedy
from tests.test_correctness import MAX_TOKENS as ALL_MAX_TOKENS
from tests.test_correctness import PROMPTS as ALL_PROMPTS
from tests.test_quantization import NEEDS_KERNELS, SCENARIOS
from tests.test_quantization_gguf import _dequantize_into
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.formats import kquant_block_bytes, pack, pack_kquant
from tokenmill.backends.cpu.plan import CpuPlan
from tokenmill.config import ModelConfig
from tokenmill.model.loader import load_model, unpermute_rope_rows
from tokenmill.model.quantization import (
    KQUANT_FORMATS,
    KQuantFormat,
    dequantize_kquant,
    kquant_of,
    kquant_parts_of,
    q8_0_of,
)
from tokenmill.model.source import resolve_model_source

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="quantization runs on the CPU only")

PROMPTS, MAX_TOKENS = ALL_PROMPTS[:10], ALL_MAX_TOKENS[:10]
GT = gguf.GGMLQuantizationType
# The float16 d (and dmin) range of `_random_blocks`, by format: weights of about 0.05 at most.
_SCALE_RANGE = {"Q4_0": (2e-3, 8e-3), "Q5_0": (1e-3, 4e-3), "Q4_K": (1e-5, 6e-5),
                "Q5_K": (5e-6, 3e-5), "Q6_K": (2e-6, 1.2e-5)}


def _random_blocks(fmt: KQuantFormat, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, k / block_values, block_bytes]: random bytes with each float16 d
    (and dmin) drawn uniformly from _SCALE_RANGE (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    nb = k // fmt.block_values
    blocks = torch.randint(0, 256, (rows, nb, fmt.block_bytes), generator=g, dtype=torch.uint8)
    lo, hi = _SCALE_RANGE[fmt.name]
    at = {"Q6_K": [208]}.get(fmt.name, [0, 2] if fmt.mins else [0])  # byte offsets of the float16 scales
    for off in at:
        scale = (torch.rand(rows, nb, generator=g) * (hi - lo) + lo).to(torch.float16)
        blocks[:, :, off:off + 2] = scale.view(torch.uint8).reshape(rows, nb, 2)
    return blocks


def _gguf_values(fmt: KQuantFormat, blocks: torch.Tensor) -> torch.Tensor:
    rows = blocks.shape[0]
    values = gguf.quants.dequantize(blocks.numpy().reshape(rows, -1), getattr(GT, fmt.name))
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


@pytest.mark.parametrize("name", list(KQUANT_FORMATS))
def test_dequantize_kquant_is_gguf_s(name: str) -> None:
    """The layouts read as gguf-py reads them: the same float32 values to the bit,
    on random blocks and (Q4_0, Q5_0) on gguf-py's own quantization."""
    fmt = KQUANT_FORMATS[name]
    blocks = _random_blocks(fmt, 8, 512)
    assert torch.equal(dequantize_kquant(fmt, blocks), _gguf_values(fmt, blocks))
    if name in ("Q4_0", "Q5_0"):
        x = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
        own = torch.from_numpy(gguf.quants.quantize(x, getattr(GT, name)).reshape(8, 3, fmt.block_bytes))
        assert torch.equal(dequantize_kquant(fmt, own), _gguf_values(fmt, own))
    # Packed: the file's bytes, but Q4_K's / Q5_K's 6-bit scales unpacked (16 bytes for 12).
    assert kquant_block_bytes(fmt) == 16 * fmt.block_bytes + (64 if fmt.mins else 0)


def _x_rounding_bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """[M, N] bound on what quantizing x per `block` values to int8 moves x W^T:
    each x by at most half its block's step max|x| / 127, times |w|."""
    m, k = x.shape
    step = x.double().abs().reshape(m, k // block, block).amax(-1) / 127
    wsum = w.double().abs().reshape(w.shape[0], k // block, block).sum(-1)
    return step / 2 @ wsum.T


@NEEDS_KERNELS
@pytest.mark.parametrize("name", list(KQUANT_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kq_gemm_against_the_dequantized_weights(name: str, dtype: torch.dtype) -> None:
    """Any number of rows, N not a multiple of 16 (and groups not a multiple of the
    task's 3), a bias. float32 x: the dequantized weights, sums within 1e-4. bf16 x:
    within the int8 rounding bound (where the build has VNNI; else the float path).
    Each row's bits the same at 1, 3, 4, 17 and 64 rows."""
    ops = kernels.load()
    assert ops is not None
    fmt = KQUANT_FORMATS[name]
    n, k = 72, 768 if fmt.block_values == 256 else 96
    blocks = _random_blocks(fmt, n, k, seed=list(KQUANT_FORMATS).index(name))
    packed = pack_kquant(ops, fmt, blocks)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (5, k // fmt.block_values, kquant_block_bytes(fmt))
    weight = _gguf_values(fmt, blocks)
    torch.manual_seed(0)
    bias = (torch.randn(n) * 0.1).to(dtype)
    w = pack(ops, name.lower(), blocks, bias)
    assert torch.equal(w.data, packed) and (w.n, w.k) == (n, k)
    x = torch.randn(64, k).to(dtype)
    x[3] = 0.0  # a zero row: scale 0
    ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    full = ops.packed_gemm(x, w, True)
    assert full.dtype == torch.float32
    if dtype == torch.float32:
        torch.testing.assert_close(full.double(), ref, atol=1e-4, rtol=0)
    else:
        bound = _x_rounding_bound(x, weight, fmt.block_values)
        assert bool(((full.double() - ref).abs() <= bound + 1e-4).all())
    for m in (1, 3, 4, 17):
        for rows in (slice(0, m), slice(64 - m, 64)):
            assert torch.equal(ops.packed_gemm(x[rows].contiguous(), w, True), full[rows])
    y = ops.packed_gemm(x, w, False)
    assert y.dtype == dtype and torch.equal(y, full.to(dtype))
    gate_up = pack(ops, name.lower(), blocks[:64])
    assert torch.equal(ops.packed_gemm_silu(x, gate_up), ops.silu_and_mul(ops.packed_gemm(x, gate_up, False)))


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_of_parts_is_its_parts_side_by_side(dtype: torch.dtype) -> None:
    """formats.PARTS (a fused qkv mixing types): each column the bits of its part's
    own GEMM, its share of the bias included, at 1 and 19 rows; gate_up's silu too.
    A PackedWeight whose parts do not add up is refused."""
    ops = kernels.load()
    assert ops is not None
    q4k, q6k = KQUANT_FORMATS["Q4_K"], KQUANT_FORMATS["Q6_K"]
    k = 512
    first, second = _random_blocks(q4k, 40, k, seed=1), _random_blocks(q6k, 24, k, seed=2)
    bias = (torch.randn(64) * 0.1).to(dtype)
    w = pack(ops, "parts", [("q4_k", first), ("q6_k", second)], bias)
    assert ops.weight_formats()[w.format] == "parts" and (w.n, w.k) == (64, k) and len(w.parts) == 2
    alone = [pack(ops, "q4_k", first, bias[:40]), pack(ops, "q6_k", second, bias[40:])]
    x = torch.randn(19, k).to(dtype)
    for m in (1, 19):
        ours = ops.packed_gemm(x[:m].contiguous(), w, True)
        assert torch.equal(ours, torch.cat([ops.packed_gemm(x[:m].contiguous(), p, True) for p in alone], 1))
    gate_up = pack(ops, "parts", [("q4_k", first[:32]), ("q6_k", second[:16].repeat(2, 1, 1))])
    assert torch.equal(ops.packed_gemm_silu(x, gate_up), ops.silu_and_mul(ops.packed_gemm(x, gate_up, False)))
    with pytest.raises(RuntimeError, match="outputs are not"):
        ops.PackedWeight(format=w.format, n=65, k=k, data=torch.empty(0, dtype=torch.uint8), bias=torch.empty(0),
                         parts=alone)


# --- tiny GGUF files ----------------------------------------------------------------

# A Llama whose matrices' inputs are multiples of 256 (the k-quants' super-blocks).
CONFIG = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2, "initializer_range": 0.02}
# The matrices' GGUF types. "q4_k_m": llama-quantize's Q4_K_M mix (Q4_K, Q6_K for
# ffn_down and the embedding, the head tied); "mixed": an untied Q4_0 head, a Q5_0
# embedding and ffn_down, Q5_K gate/up, a Q6_K attn_v beside Q4_K q/k (so the
# fused qkv is two parts: Q4_K q and k, Q6_K v, as about half of a Q4_K_M file's layers).
LAYOUTS: dict[str, dict[str, Any]] = {
    "q4_k_m": {"tied": True, "types": {"token_embd": GT.Q6_K, "ffn_down": GT.Q6_K}, "default": GT.Q4_K},
    "mixed": {"tied": False, "default": GT.Q4_K,
              "types": {"token_embd": GT.Q5_0, "output": GT.Q4_0, "ffn_down": GT.Q5_0, "ffn_gate": GT.Q5_K,
                        "ffn_up": GT.Q5_K, "attn_v": GT.Q6_K, "attn_output": GT.Q4_0}},
}


def _write_gguf(hf_model: Any, path: Path, layout: dict[str, Any]) -> dict[str, tuple[Any, np.ndarray]]:
    """hf_model as a GGUF file, each matrix of its layout's type (Q4_0 / Q5_0 by
    gguf-py's quantize of the weight, k-quants by _random_blocks); norms float32.
    Each matrix's (type, blocks as written)."""
    writer = gguf_writer(hf_model, path)
    written: dict[str, tuple[Any, np.ndarray]] = {}
    for i, (gguf_name, part, _, weight, _) in enumerate(gguf_tensors(hf_model)):
        if weight.ndim != 2:
            writer.add_tensor(gguf_name, weight)
            continue
        kind = layout["types"].get(part, layout["default"])
        fmt = KQUANT_FORMATS[kind.name]
        if kind in (GT.Q4_0, GT.Q5_0):
            data = gguf.quants.quantize(weight, kind)
        else:
            data = _random_blocks(fmt, weight.shape[0], weight.shape[1], seed=i).numpy()
        data = data.reshape(weight.shape[0], -1)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        written[gguf_name] = (kind, data)
    finish_gguf(writer)
    return written


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gguf_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layout = LAYOUTS[request.param]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=layout["tied"])
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    written = _write_gguf(hf_model, path, layout)
    _dequantize_into(hf_model, written)
    refs = [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    return {"name": request.param, "path": str(path), "written": written, "refs": refs}


def _raw(written: dict[str, tuple[Any, np.ndarray]], name: str, heads: int | None = None) -> torch.Tensor:
    kind, data = written[name]
    fmt = KQUANT_FORMATS[kind.name]
    blocks = torch.from_numpy(np.ascontiguousarray(data).reshape(data.shape[0], -1, fmt.block_bytes))
    return blocks if heads is None else unpermute_rope_rows(blocks, heads)


def _kept(module: torch.nn.Module, kind: Any) -> torch.Tensor:
    kept = kquant_of(module)
    assert kept is not None and kept[0].name == kind.name, (kept and kept[0].name, kind.name)
    assert "weight" not in module._parameters  # no float copy
    return kept[1]


def test_the_files_blocks_are_kept_as_they_are(gguf_case: dict[str, Any]) -> None:
    """Each module whose tensors are all of one kept type holds the file's bytes."""
    model, spec = load_model(ModelConfig(dtype="float32", quantization="gguf"),
                             resolve_model_source(gguf_case["path"]))
    written = gguf_case["written"]

    def kind(name: str) -> Any:
        return written[name][0]

    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        o = f"blk.{i}.attn_output.weight"
        assert torch.equal(_kept(attn.o_proj, kind(o)), _raw(written, o))
        down = f"blk.{i}.ffn_down.weight"
        assert torch.equal(_kept(mlp.down_proj, kind(down)), _raw(written, down))
        gate, up = f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"
        assert torch.equal(_kept(mlp.gate_up_proj, kind(gate)), torch.cat([_raw(written, gate), _raw(written, up)]))
        q, k, v = (f"blk.{i}.attn_{p}.weight" for p in "qkv")
        if gguf_case["name"] == "mixed":  # Q4_K q/k beside a Q6_K v: two parts, each as the file has it
            parts = kquant_parts_of(attn.qkv_proj)
            assert kquant_of(attn.qkv_proj) is None and q8_0_of(attn.qkv_proj) is None and parts is not None
            assert [fmt.name for fmt, _ in parts] == ["Q4_K", "Q6_K"] and "weight" not in attn.qkv_proj._parameters
            assert torch.equal(parts[0][1], torch.cat([_raw(written, q, spec.num_heads),
                                                       _raw(written, k, spec.num_kv_heads)]))
            assert torch.equal(parts[1][1], _raw(written, v))
        else:
            assert torch.equal(_kept(attn.qkv_proj, kind(q)), torch.cat([
                _raw(written, q, spec.num_heads), _raw(written, k, spec.num_kv_heads), _raw(written, v)]))
    embed = _kept(model.model.embed_tokens, kind("token_embd.weight"))
    assert torch.equal(embed, _raw(written, "token_embd.weight"))
    if gguf_case["name"] == "mixed":
        assert torch.equal(_kept(model.lm_head, kind("output.weight")), _raw(written, "output.weight"))
    else:  # tied: the head shares the embedding's blocks
        assert _kept(model.lm_head, kind("token_embd.weight")) is embed


def _generate(llm: LLM, n: int = len(PROMPTS)) -> list[Any]:
    params = [SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True, logprobs=0)
              for t in MAX_TOKENS[:n]]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:n]], params, use_tqdm=False)


def _check_greedy(outs: list[Any], refs: list[Any]) -> None:
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outs, refs, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}"
        assert completion.logprobs is not None
        ours = [entry[tok].logprob for entry, tok in zip(completion.logprobs, ref_tokens, strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")


def test_reference_model_dequantizes_on_the_fly(gguf_case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C++ kernels off the reference model serves the kept blocks
    (dequantized each call): transformers' greedy tokens, logprobs within 1e-4."""
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    llm = LLM(gguf_case["path"], dtype="float32", quantization="gguf", skip_tokenizer_init=True,
              num_kv_blocks=512)
    assert not isinstance(llm.engine.runner.forward, CpuPlan)
    outs = _generate(llm, 4)
    _check_greedy(outs, gguf_case["refs"][:4])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_the_dequantized_reference(gguf_case: dict[str, Any], scenario: str) -> None:
    """float32 activations through the CPU plan: transformers' greedy tokens on the
    file's values, logprobs within 1e-4, under chunked prefill and preemption."""
    llm = LLM(gguf_case["path"], dtype="float32", quantization="gguf", skip_tokenizer_init=True,
              check_integrity=True, **SCENARIOS[scenario])
    if kernels.load() is not None:  # the plan computes on the file's own blocks
        plan = llm.engine.runner.forward
        assert isinstance(plan, CpuPlan)
        names = plan.ops.weight_formats()
        expect = {"q4_k_m": ("q4_k", "q4_k", "q6_k"), "mixed": ("parts", "q5_k", "q5_0")}[gguf_case["name"]]
        for layer in plan.layers:
            assert (names[layer.qkv.format], names[layer.gate_up.format], names[layer.down.format]) == expect
            if gguf_case["name"] == "mixed":
                assert [names[part.format] for part in layer.qkv.parts] == ["q4_k", "q6_k"]
    _check_greedy(_generate(llm), gguf_case["refs"])
    if scenario == "preempt":
        assert llm.engine.stats().num_preemptions > 0


def test_the_plan_holds_the_only_copy_of_each_kquant_weight(gguf_case: dict[str, Any]) -> None:
    """The runner's plan packs the file's blocks and releases each module's own (a
    meta tensor of the same shape remains), but for the embedding's, which it reads."""
    llm = LLM(gguf_case["path"], dtype="float32", quantization="gguf", skip_tokenizer_init=True,
              num_kv_blocks=512)
    plan = llm.engine.runner.forward
    if not isinstance(plan, CpuPlan):
        pytest.skip("the C++ kernels are not built here")
    model = llm.engine.runner.model.model
    layer = model.layers[0]
    for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        kept = kquant_of(module)
        assert kept is not None and kept[1].device.type == "meta", module
    parts = kquant_parts_of(layer.self_attn.qkv_proj)
    if gguf_case["name"] == "mixed":
        assert parts is not None and all(blocks.device.type == "meta" for _, blocks in parts)
    embed = kquant_of(model.embed_tokens)
    assert embed is not None and embed[1].device.type == "cpu"
    assert plan.layers[0].o.data.device.type == "cpu"


def test_bf16_logprobs_near_the_dequantized_reference(gguf_case: dict[str, Any]) -> None:
    """bf16 activations (kq_gemm's int8 path): logprobs within 0.1 of the float32 reference."""
    llm = LLM(gguf_case["path"], dtype="bfloat16", quantization="gguf", skip_tokenizer_init=True,
              num_kv_blocks=512)
    worst, compared = 0.0, 0
    for out, (ref_tokens, ref_logprobs) in zip(_generate(llm), gguf_case["refs"], strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        same = 0
        while same < len(ref_tokens) and completion.token_ids[same] == ref_tokens[same]:
            same += 1
        for entry, tok, ref in zip(completion.logprobs[:same], ref_tokens[:same], ref_logprobs[:same],
                                   strict=True):
            worst = max(worst, abs(entry[tok].logprob - ref))
            compared += 1
    assert compared > 0 and worst < 0.1
