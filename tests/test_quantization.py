"""quantization="q8_0": GGUF Q8_0 blocks kept quantized, computed on by the CPU
plan's q8_gemm (csrc/q8_gemm.cpp) without a float copy of the weights.

The oracle is the model on the dequantized weights (q * d, the same values in
float32): transformers for Hugging Face checkpoints, tokenmill's float path for
a GGUF file (itself held to transformers by test_model_loading.py).

Tolerances: in float32 the plan's weights are the dequantized values to the bit
(q * d is exact in float32) and only the order of the sums differs, so logprobs
agree within 1e-4 (as test_correctness.py's float32 plan against transformers)
and greedy tokens are equal. In bfloat16 the activations are rounded to bf16
(8 significant bits) between the ops, and each GEMM's input is quantized to
int8 per block of 32 (as llama.cpp's Q8_0 dot: up to half a step of max|x| /
127 an input, a bound test_q8_gemm_against_the_dequantized_weights checks per
output): logprobs are held within 0.1 of the float32 reference (measured:
0.034-0.042 on these three models), a few bf16 steps of their logits
(magnitude ~5); greedy tokens are not compared there (near-ties may flip).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.hf_models import (
    COMMON,
    TEST_DEVICE,
    build_hf_model,
    finish_gguf,
    gguf_tensors,
    gguf_writer,
    hf_greedy,
    save_hf_model,
)
from tests.test_correctness import MAX_TOKENS as ALL_MAX_TOKENS
from tests.test_correctness import PROMPTS as ALL_PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import formats, kernels
from tokenmill.backends.cpu.plan import CpuPlan
from tokenmill.config import ModelConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.model.llama import Linear, SparseMoeBlock
from tokenmill.model.loader import load_model, unpermute_rope_rows
from tokenmill.model.quantization import (
    dequantize_q8_0,
    embed_rows,
    q8_0_of,
    quantize_q8_0,
    set_q8_0,
)
from tokenmill.model.source import resolve_model_source

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="quantization runs on the CPU only")

# test_correctness.py's prompts (half of them sharing a prefix), 12 of them: CI time.
PROMPTS, MAX_TOKENS = ALL_PROMPTS[:12], ALL_MAX_TOKENS[:12]

NEEDS_KERNELS = pytest.mark.skipif(
    kernels.packed_gemm_ops(torch.empty(1, 2)) is None, reason="no C++ GEMM on this machine")


def _dequantized(hf_model: torch.nn.Module) -> torch.nn.Module:
    """hf_model with every matrix but the norms and a MoE router (kept float:
    llama.Router) set to its Q8_0 round trip, stacked experts [E, out, in] each."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                param.copy_(dequantize_q8_0(*quantize_q8_0(param)))
    return hf_model


def test_quantize_is_llama_cpps_rule() -> None:
    """quantize_q8_0 gives the bytes of the gguf package's Q8_0 (llama.cpp's rule)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 96)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, 5] = 40.0  # an outlier
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(8, 3, 34)
    q, d = quantize_q8_0(torch.from_numpy(x))
    assert np.array_equal(d.numpy().view(np.uint8).reshape(8, 3, 2), ref[:, :, :2])
    assert np.array_equal(q.numpy().view(np.uint8).reshape(8, 3, 32), ref[:, :, 2:])
    back = gguf.quants.dequantize(ref.reshape(8, -1), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_q8_0(q, d).numpy(), back)


def _x_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on what quantizing x per block of 32 to int8 (q8_gemm's VNNI
    path for bf16 x) moves x W^T: each x by at most half its block's step
    max|x| / 127, times |w|."""
    m, k = x.shape
    step = x.double().abs().reshape(m, k // 32, 32).amax(-1) / 127  # [M, K/32]
    wsum = w.double().abs().reshape(w.shape[0], k // 32, 32).sum(-1)  # [N, K/32]
    return step / 2 @ wsum.T


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_gemm_against_the_dequantized_weights(dtype: torch.dtype) -> None:
    """Any number of rows, N not a multiple of 16, a bias; each row's bits the
    same whatever the other rows (the batch does not change a row). float32 x:
    the reference's weights to the bit, the sums in another order (1e-4). bf16
    x: within the bound of x's rounding to int8 (where the build has VNNI)."""
    ops = kernels.packed_gemm_ops(torch.empty(1, 2, dtype=dtype))
    if ops is None:
        pytest.skip(f"no {dtype} GEMM in this build")
    torch.manual_seed(0)
    n, k = 40, 96
    q, d = quantize_q8_0(torch.randn(n, k))
    bias = torch.randn(n).to(dtype)
    packed = formats.pack(ops, "q8_0", (q, d), bias)
    assert packed.data.dtype == torch.uint8 and tuple(packed.data.shape) == (3, 64 * 2 + 16 * k)
    weight = dequantize_q8_0(q, d)
    x = torch.randn(13, k).to(dtype)
    ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    slack = 1e-4 + (_x_rounding_bound(x, weight) if dtype == torch.bfloat16 else 0.0)
    full = ops.packed_gemm(x, packed, True)
    assert full.dtype == torch.float32
    assert bool(((full.double() - ref).abs() <= slack + 1e-5 * ref.abs()).all())
    if dtype == torch.float32:
        torch.testing.assert_close(full.double(), ref, atol=1e-4, rtol=1e-5)
    for m in (1, 2, 3, 5, 7):
        assert torch.equal(ops.packed_gemm(x[:m], packed, True), full[:m])
        assert torch.equal(ops.packed_gemm(x[m:], packed, True), full[m:])
    y16 = ops.packed_gemm(x, packed, False)
    assert y16.dtype == dtype
    assert torch.equal(y16, full.to(dtype))
    packed_32 = formats.pack(ops, "q8_0", (q[:32], d[:32]))
    gate_up = ops.packed_gemm(x, packed_32, False)
    assert torch.equal(ops.packed_gemm_silu(x, packed_32), ops.silu_and_mul(gate_up))


def _unpack_q8_0(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K], d [N, K/32] read back from pack_q8_0's bytes by the layout's
    rule (csrc/q8_gemm.cpp's header), one value at a time."""
    raw = packed.reshape(-1).tolist()
    groups, kb_count = packed.shape[0], k // 32
    group_bytes = packed.shape[1]
    q = torch.zeros(n, k, dtype=torch.int16)
    d = torch.zeros(n, kb_count, dtype=torch.float16)
    for out in range(n):
        g = out // 16
        t, j, i = g // 3, g % 3, out % 16
        nb = min(3, groups - 3 * t)
        task = 3 * t * group_bytes
        for kb in range(kb_count):
            pair = task + kb // 2 * nb * 1088
            at = pair + (kb % 2 * nb + j) * 32 + 2 * i
            d[out, kb] = torch.tensor([raw[at] | raw[at + 1] << 8], dtype=torch.int16).view(torch.float16)
            for kk in range(8):
                at = pair + 64 * nb + ((kb % 2 * 8 + kk) * nb + j) * 64 + 4 * i
                for b in range(4):
                    q[out, kb * 32 + 4 * kk + b] = raw[at + b] - 128
    return q.to(torch.int8), d


@NEEDS_KERNELS
def test_q8_layout_and_row_counts() -> None:
    """pack_q8_0's bytes follow the documented layout (three groups a task,
    the last task partial, an odd number of blocks), and q8_gemm gives each
    row the same bits at 1, 3, 4, 17 and 64 rows (the row tiles and the
    prefetch stream change no bits), within x's int8 rounding of the reference."""
    ops = kernels.packed_gemm_ops(torch.empty(1, 2, dtype=torch.bfloat16))
    if ops is None:
        pytest.skip("no bfloat16 GEMM in this build")
    torch.manual_seed(1)
    n, k = 16 * 7 + 5, 160  # 8 groups: tasks of 3, 3, 2; 5 blocks
    q, d = quantize_q8_0(torch.randn(n, k))
    packed = formats.pack(ops, "q8_0", (q, d))
    assert tuple(packed.data.shape) == (8, 64 * 3 + 16 * k)
    back_q, back_d = _unpack_q8_0(packed.data, n, k)
    assert torch.equal(back_q, q) and torch.equal(back_d, d)
    weight = dequantize_q8_0(q, d)
    x = torch.randn(64, k).to(torch.bfloat16)
    full = ops.packed_gemm(x, packed, True)
    ref = torch.nn.functional.linear(x.double(), weight.double())
    assert bool(((full.double() - ref).abs() <= 1e-4 + _x_rounding_bound(x, weight) + 1e-5 * ref.abs()).all())
    for m in (1, 3, 4, 17):
        for start in (0, 64 - m):
            assert torch.equal(ops.packed_gemm(x[start:start + m], packed, True), full[start:start + m])


@pytest.fixture(scope="module", params=["llama", "llama3-tied", "qwen2", "qwen3-moe", "mixtral"])
def q8_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch = request.param
    model = build_hf_model(arch)
    path = save_hf_model(model, Path(tmp_path_factory.mktemp(arch)))  # the float weights
    _dequantized(model)
    refs = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    return {"path": path, "refs": refs}


SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {"num_kv_blocks": 512},
    "budget8": {"max_num_batched_tokens": 8, "num_kv_blocks": 512},
    "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 64},
}


def _generate(llm: LLM) -> list[Any]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in MAX_TOKENS]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_the_dequantized_reference(q8_case: dict[str, Any], scenario: str) -> None:
    """float32 activations: the same greedy tokens as transformers on the
    dequantized weights, logprobs within 1e-4, under chunked prefill and preemption."""
    llm = LLM(q8_case["path"], dtype="float32", quantization="q8_0", skip_tokenizer_init=True,
              check_integrity=True, **SCENARIOS[scenario])
    runner = llm.engine.runner
    if kernels.load() is not None:
        assert isinstance(runner.forward, CpuPlan)
        q8_0 = formats.FORMATS["q8_0"].kernel
        assert all(ops_formats()[layer.qkv.format] == q8_0 for layer in runner.forward.layers)
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(_generate(llm), q8_case["refs"], strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}"
        assert completion.logprobs is not None
        ours = [entry[tok].logprob for entry, tok in zip(completion.logprobs, ref_tokens, strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
    if scenario == "preempt":
        assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_embed_gives_embed_rows_bits(dtype: torch.dtype) -> None:
    """The plan's embedding (csrc q8_embed) against model/quantization.py's embed_rows."""
    ops = kernels.load()
    if ops is None:
        pytest.skip("the C++ kernels are not built here")
    table = torch.nn.Embedding(300, 96)
    torch.nn.init.normal_(table.weight, std=3.0)
    q, d = quantize_q8_0(table.weight.detach())
    set_q8_0(table, q, d)
    ids = torch.tensor([0, 299, 7, 7, 150, 42])
    ours = ops.q8_embed(q, d, ids, dtype == torch.float32)
    assert ours.dtype == dtype and torch.equal(ours, embed_rows(table, ids, dtype))
    with pytest.raises(RuntimeError, match="id out of range"):
        ops.q8_embed(q, d, torch.tensor([300]), False)


def ops_formats() -> list[str]:
    ops = kernels.load()
    assert ops is not None
    return list(ops.weight_formats())


def test_the_plan_holds_the_only_copy_of_each_q8_0_weight(q8_case: dict[str, Any]) -> None:
    """The runner's plan packs each projection's Q8_0 blocks and releases the
    module's own (meta tensors of the same shape remain: the size still counts,
    a reference forward through them fails); the embedding keeps its blocks
    (its rows come from q8_embed), which a tied head shares."""
    llm = LLM(q8_case["path"], dtype="bfloat16", quantization="q8_0", skip_tokenizer_init=True,
              num_kv_blocks=64)
    plan = llm.engine.runner.forward
    if not isinstance(plan, CpuPlan):
        pytest.skip("the C++ kernels are not built here")
    model = llm.engine.runner.model
    mlp = model.model.layers[1].mlp  # (a mixture of experts: its last expert's; its router is float)
    down = mlp.experts[-1].down_proj if isinstance(mlp, SparseMoeBlock) else mlp.down_proj
    if isinstance(mlp, SparseMoeBlock):
        assert mlp.gate.weight.device.type == "meta" and mlp.gate.weight.dtype == torch.bfloat16
    assert down.qweight.device.type == "meta" and down.qscale.device.type == "meta"
    assert down.qweight.shape == (down.out_features, down.in_features)
    assert model.model.embed_tokens.qweight.device.type == "cpu"
    assert llm.model_info()["num_params"] > 0
    with pytest.raises(RuntimeError, match="released to the CPU plan"):
        down(torch.zeros(1, down.in_features))
    assert len(_generate(llm)) == len(PROMPTS)


def test_bf16_logprobs_near_the_dequantized_reference(q8_case: dict[str, Any]) -> None:
    llm = LLM(q8_case["path"], dtype="bfloat16", quantization="q8_0", skip_tokenizer_init=True,
              num_kv_blocks=512)
    worst = 0.0
    for out, (ref_tokens, ref_logprobs) in zip(_generate(llm), q8_case["refs"], strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        # Each step's logprob of the token it chose, and the reference's for that
        # token where both took the same path so far.
        same = 0
        while same < len(ref_tokens) and completion.token_ids[same] == ref_tokens[same]:
            same += 1
        for entry, tok, ref in zip(completion.logprobs[:same], ref_tokens[:same], ref_logprobs[:same],
                                   strict=True):
            worst = max(worst, abs(entry[tok].logprob - ref))
    assert worst < 0.1


# --- a GGUF file's own Q8_0 blocks ------------------------------------------------

def _write_q8_0_gguf(hf_model: Any, path: Path) -> dict[str, np.ndarray]:
    """hf_model as a GGUF file with every matrix in Q8_0 (norms float32, as
    llama.cpp writes them); returns each Q8_0 tensor's blocks as written."""
    writer = gguf_writer(hf_model, path)
    written: dict[str, np.ndarray] = {}
    for gguf_name, _, _, weight, _ in gguf_tensors(hf_model):
        if weight.ndim == 2:
            data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            written[gguf_name] = data
        else:
            writer.add_tensor(gguf_name, weight)
    finish_gguf(writer)
    return written


def _tiny_llama(tied: bool) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _blocks(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    rows = data.shape[0]
    raw = data.reshape(rows, -1, 34)
    d = torch.from_numpy(np.ascontiguousarray(raw[:, :, :2]).view(np.float16).reshape(rows, -1))
    q = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(rows, -1))
    return q, d


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_q8_0_blocks_are_kept_as_they_are(tmp_path: Path, tied: bool) -> None:
    hf_model = _tiny_llama(tied)
    path = tmp_path / "tiny-q8_0.gguf"
    written = _write_q8_0_gguf(hf_model, path)
    source = resolve_model_source(str(path))
    model, spec = load_model(ModelConfig(dtype="float32", quantization="q8_0"), source)
    assert spec.tie_word_embeddings == tied
    heads = {"q": spec.num_heads, "k": spec.num_kv_heads}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert "weight" not in attn.qkv_proj._parameters  # no float copy
        q8 = q8_0_of(attn.qkv_proj)
        assert q8 is not None
        start = 0
        for shard, part in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            q, d = _blocks(written[f"blk.{i}.{part}.weight"])
            if shard in heads:
                q, d = unpermute_rope_rows(q, heads[shard]), unpermute_rope_rows(d, heads[shard])
            rows = slice(start, start + q.shape[0])
            start += q.shape[0]
            assert torch.equal(q8[0][rows], q) and torch.equal(q8[1][rows], d)
        down = q8_0_of(layer.mlp.down_proj)
        assert down is not None
        assert torch.equal(down[0], _blocks(written[f"blk.{i}.ffn_down.weight"])[0])
    embed = q8_0_of(model.model.embed_tokens)
    assert embed is not None and torch.equal(embed[0], _blocks(written["token_embd.weight"])[0])
    head = q8_0_of(model.lm_head)
    assert head is not None and (head[0] is embed[0]) == tied
    assert model.model.norm.weight.dtype == torch.float32  # norms stay float

    # The plan on the blocks against the float path on the dequantized file.
    prompts = PROMPTS[:8]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0) for _ in prompts]
    outs = {}
    for quantization in (None, "q8_0"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, skip_tokenizer_init=True,
                  num_kv_blocks=256, max_num_batched_tokens=32)
        outs[quantization] = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                          use_tqdm=False)
    for ref, ours in zip(outs[None], outs["q8_0"], strict=True):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        ref_lp = [e[t].logprob for e, t in zip(ref.outputs[0].logprobs or [], ref.outputs[0].token_ids,
                                                strict=True)]
        our_lp = [e[t].logprob for e, t in zip(ours.outputs[0].logprobs or [], ours.outputs[0].token_ids,
                                                strict=True)]
        np.testing.assert_allclose(our_lp, ref_lp, atol=1e-4)


def test_reference_model_dequantizes_on_the_fly(q8_case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C++ kernels off the reference model serves the quantized weights."""
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    llm = LLM(q8_case["path"], dtype="float32", quantization="q8_0", skip_tokenizer_init=True,
              num_kv_blocks=512)
    assert not isinstance(llm.engine.runner.forward, CpuPlan)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:6]],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                         for n in MAX_TOKENS[:6]], use_tqdm=False)
    for out, (ref_tokens, _) in zip(outs, q8_case["refs"][:6], strict=True):
        assert out.outputs[0].token_ids == ref_tokens
    assert any(isinstance(m, Linear) and q8_0_of(m) is not None for m in llm.engine.runner.model.modules())


def test_bad_quantization_values_are_refused(q8_case: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported; use one of \('none', 'q8_0', 'gguf'\), "
                                         r"or leave it unset"):
        LLM(q8_case["path"], quantization="int4", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization='q8_0' runs on the CPU only"):
        ModelConfig(quantization="q8_0", device="cuda")
    with pytest.raises(ValueError, match="quantization='q8_0' cannot be used with tensor_parallel_size=2"):
        EngineArgs(quantization="q8_0", tensor_parallel_size=2).create_parallel_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "q8_0"])).quantization == "q8_0"
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'int4'"):
        parser.parse_args(["--quantization", "int4"])


def test_bench_interactive_has_a_q8_0_tokenmill_column() -> None:
    """`bench interactive --servers tokenmill-q8_0` starts `tokenmill serve --quantization q8_0`."""
    from tokenmill.bench import interactive

    parser = argparse.ArgumentParser()
    interactive.add_args(parser)
    args = parser.parse_args(["--servers", "tokenmill-q8_0"])
    (spec,) = interactive.server_specs(args, ["tokenmill-q8_0"])
    assert spec.label == "tokenmill-q8_0"
    assert spec.cmd[-2:] == ["--quantization", "q8_0"] and "--quantization q8_0" in spec.settings
