"""quantization="gguf": a GGUF file's own Q4_1, Q4_0 and Q8_0 blocks kept as
they are, computed on by the CPU plan's q4_gemm (csrc/q4_gemm.cpp) and q8_gemm.

The oracle is transformers on the dequantized weights (d * q + m, the same values
in float32). Tolerances as tests/test_quantization.py: float32 activations give
the dequantized weights to the bit (1e-4 on logprobs, equal greedy tokens); bf16
activations are quantized to int8 per block of 32 in each GEMM (bounded per
output in test_q4_gemm_against_the_dequantized_weights).
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
    finish_gguf,
    gguf_tensors,
    gguf_writer,
    hf_greedy,
    save_hf_model,
)
from tests.test_correctness import MAX_TOKENS as ALL_MAX_TOKENS
from tests.test_correctness import PROMPTS as ALL_PROMPTS
from tests.test_quantization import NEEDS_KERNELS, SCENARIOS, _x_rounding_bound
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import formats, kernels
from tokenmill.backends.cpu.plan import CpuPlan
from tokenmill.config import ModelConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.model.loader import load_model, unpermute_rope_rows
from tokenmill.model.quantization import (
    dequantize_q4_1,
    dequantize_q8_0,
    kquant_of,
    q4_0_as_q4_1,
    q4_1_of,
    q8_0_of,
    quantize_q8_0,
)
from tokenmill.model.source import resolve_model_source

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="quantization runs on the CPU only")

PROMPTS, MAX_TOKENS = ALL_PROMPTS[:12], ALL_MAX_TOKENS[:12]
Q4_0, Q4_1, Q8_0, F16 = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                         gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16)


def _q4_1_blocks(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random weights [rows, k] as gguf's Q4_1 blocks, uint8 [rows, k / 32, 20]."""
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.5  # a constant block: d = 0
    return gguf.quants.quantize(x, Q4_1).reshape(rows, k // 32, 20)


def test_dequantize_q4_is_gguf_s() -> None:
    """dequantize_q4_1 gives gguf's values to the bit; Q4_0 made Q4_1 keeps its values."""
    blocks = _q4_1_blocks(8, 96)
    ref = gguf.quants.dequantize(blocks.reshape(8, -1), Q4_1)
    assert np.array_equal(dequantize_q4_1(torch.from_numpy(blocks)).numpy(), ref)
    x = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    q4_0 = gguf.quants.quantize(x, Q4_0).reshape(8, 3, 18)
    as_q4_1 = q4_0_as_q4_1(torch.from_numpy(q4_0))
    assert as_q4_1.shape == (8, 3, 20)
    assert np.array_equal(dequantize_q4_1(as_q4_1).numpy(),
                          gguf.quants.dequantize(q4_0.reshape(8, -1), Q4_0))


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_gemm_against_the_dequantized_weights(dtype: torch.dtype) -> None:
    """Any number of rows, N not a multiple of 16, a bias; a row's bits the same
    whatever the other rows. float32 x: the dequantized weights to the bit, the
    sums in another order (1e-4). bf16 x: within the bound of x's int8 rounding."""
    ops = kernels.packed_gemm_ops(torch.empty(1, 2, dtype=dtype))
    if ops is None:
        pytest.skip(f"no {dtype} GEMM in this build")
    torch.manual_seed(0)
    n, k = 40, 96
    blocks = torch.from_numpy(_q4_1_blocks(n, k))
    bias = torch.randn(n).to(dtype)
    packed = formats.pack(ops, "q4_1", blocks, bias)
    assert packed.data.dtype == torch.uint8 and tuple(packed.data.shape) == (3, 3, 320)
    weight = dequantize_q4_1(blocks)
    x = torch.randn(13, k).to(dtype)
    ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    slack = 1e-4 + (_x_rounding_bound(x, weight) if dtype == torch.bfloat16 else 0.0)
    full = ops.packed_gemm(x, packed, True)
    assert full.dtype == torch.float32
    assert bool(((full.double() - ref).abs() <= slack + 1e-5 * ref.abs()).all())
    if dtype == torch.float32:
        torch.testing.assert_close(full.double(), ref, atol=1e-4, rtol=1e-5)
    for m in (1, 2, 3, 4, 5, 7):
        assert torch.equal(ops.packed_gemm(x[:m], packed, True), full[:m])
        assert torch.equal(ops.packed_gemm(x[m:], packed, True), full[m:])
    y16 = ops.packed_gemm(x, packed, False)
    assert y16.dtype == dtype and torch.equal(y16, full.to(dtype))
    gate_up = formats.pack(ops, "q4_1", blocks[:32])
    assert torch.equal(ops.packed_gemm_silu(x, gate_up), ops.silu_and_mul(ops.packed_gemm(x, gate_up, False)))


# --- tiny GGUF files ----------------------------------------------------------------

# The matrices' GGUF types: "q4_1" as the default model's file (Q4_1, a Q8_0 token_embd,
# tied head); "mixed": an untied Q4_1 head, a Q4_0 embedding and ffn_down (kept as
# Q4_0: csrc/kq_gemm.cpp, tests/test_quantization_kquants.py), and an F16
# attn_v (so the fused qkv is Q8_0: the Q4_1 q/k requantized, as quantization="q8_0").
LAYOUTS: dict[str, dict[str, Any]] = {
    "q4_1": {"tied": True, "types": {"token_embd": Q8_0}},
    "mixed": {"tied": False, "types": {"token_embd": Q4_0, "ffn_down": Q4_0, "attn_v": F16},
              "as_q8_0": ("attn_q", "attn_k", "attn_v")},
}


def _write_gguf(hf_model: Any, path: Path, types: dict[str, Any]) -> dict[str, tuple[Any, np.ndarray]]:
    """hf_model as a GGUF file (matrices Q4_1 unless `types` names the part;
    norms float32); each matrix's (type, data as written)."""
    writer = gguf_writer(hf_model, path)
    written: dict[str, tuple[Any, np.ndarray]] = {}
    for gguf_name, part, _, weight, _ in gguf_tensors(hf_model):
        if weight.ndim != 2:
            writer.add_tensor(gguf_name, weight)
            continue
        kind = types.get(part, Q4_1)
        data = weight.astype(np.float16) if kind == F16 else gguf.quants.quantize(weight, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        written[gguf_name] = (kind, data)
    finish_gguf(writer)
    return written


def _dequantize_into(hf_model: Any, written: dict[str, tuple[Any, np.ndarray]],
                     as_q8_0: tuple[str, ...] = ()) -> None:
    """Each of hf_model's matrices set to the file's values (llama.cpp's Q/K row
    order undone); the parts in `as_q8_0` to those values' Q8_0 round trip."""
    cfg = hf_model.config
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    state = hf_model.state_dict()
    with torch.no_grad():
        for gguf_name, _, part_heads, _, param in gguf_tensors(hf_model):
            if gguf_name not in written:
                continue
            kind, data = written[gguf_name]
            values = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32))
            values = values.reshape(param.shape)
            part = gguf_name.split(".")[-2]
            if part_heads is not None:
                values = unpermute_rope_rows(values, heads[part])
            if part in as_q8_0:
                values = dequantize_q8_0(*quantize_q8_0(values))
            param.copy_(values)
        if cfg.tie_word_embeddings:
            assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gguf_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layout = LAYOUTS[request.param]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=layout["tied"])
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    written = _write_gguf(hf_model, path, layout["types"])
    _dequantize_into(hf_model, written, layout.get("as_q8_0", ()))
    refs = [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    return {"name": request.param, "path": str(path), "written": written, "refs": refs,
            "hf_model": hf_model}


def _raw(written: dict[str, tuple[Any, np.ndarray]], name: str, heads: int | None = None) -> torch.Tensor:
    kind, data = written[name]
    size = {Q4_1: 20, Q4_0: 18}[kind]
    blocks = torch.from_numpy(np.ascontiguousarray(data).reshape(data.shape[0], -1, size))
    return blocks if heads is None else unpermute_rope_rows(blocks, heads)


def _held(module: torch.nn.Module) -> torch.Tensor | None:
    """A module's Q4_1 blocks, or its Q4_0 ones (kept as Q4_0 where alone)."""
    kept = kquant_of(module)
    return q4_1_of(module) if kept is None else kept[1]


def test_the_files_blocks_are_kept_as_they_are(gguf_case: dict[str, Any]) -> None:
    model, spec = load_model(ModelConfig(dtype="float32", quantization="gguf"),
                             resolve_model_source(gguf_case["path"]))
    written = gguf_case["written"]
    mixed = gguf_case["name"] == "mixed"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert "weight" not in module._parameters  # no float copy
        assert torch.equal(q4_1_of(attn.o_proj), _raw(written, f"blk.{i}.attn_output.weight"))
        assert torch.equal(_held(mlp.down_proj), _raw(written, f"blk.{i}.ffn_down.weight"))
        gate_up = q4_1_of(mlp.gate_up_proj)
        assert gate_up is not None
        assert torch.equal(gate_up, torch.cat([_raw(written, f"blk.{i}.ffn_gate.weight"),
                                               _raw(written, f"blk.{i}.ffn_up.weight")]))
        if mixed:  # an F16 part: the fused qkv is Q8_0
            assert q4_1_of(attn.qkv_proj) is None and q8_0_of(attn.qkv_proj) is not None
        else:
            qkv = q4_1_of(attn.qkv_proj)
            assert qkv is not None and torch.equal(qkv, torch.cat([
                _raw(written, f"blk.{i}.attn_q.weight", spec.num_heads),
                _raw(written, f"blk.{i}.attn_k.weight", spec.num_kv_heads),
                _raw(written, f"blk.{i}.attn_v.weight")]))
    assert model.model.norm.weight.dtype == torch.float32  # norms stay float
    if mixed:
        assert torch.equal(_held(model.model.embed_tokens), _raw(written, "token_embd.weight"))
        assert torch.equal(q4_1_of(model.lm_head), _raw(written, "output.weight"))
    else:  # the default file's shape: a Q8_0 embedding, the head sharing its blocks
        embed, head = q8_0_of(model.model.embed_tokens), q8_0_of(model.lm_head)
        raw = written["token_embd.weight"][1]
        assert embed is not None and head is not None and head[0] is embed[0]
        assert np.array_equal(embed[0].numpy().view(np.uint8),
                              raw.reshape(raw.shape[0], -1, 34)[:, :, 2:].reshape(raw.shape[0], -1))


def _generate(llm: LLM, n: int = len(PROMPTS)) -> list[Any]:
    params = [SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True, logprobs=0)
              for t in MAX_TOKENS[:n]]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:n]], params, use_tqdm=False)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_the_dequantized_reference(gguf_case: dict[str, Any], scenario: str) -> None:
    """float32 activations: transformers' greedy tokens on the file's values,
    logprobs within 1e-4, under chunked prefill and preemption."""
    llm = LLM(gguf_case["path"], dtype="float32", quantization="gguf", skip_tokenizer_init=True,
              check_integrity=True, **SCENARIOS[scenario])
    if kernels.load() is not None:
        plan = llm.engine.runner.forward
        assert isinstance(plan, CpuPlan)
        kernels_here = plan.ops.weight_formats()
        down = "q4_0" if gguf_case["name"] == "mixed" else "q4_1"  # the file's blocks
        assert all(kernels_here[layer.down.format] == down for layer in plan.layers)
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(_generate(llm), gguf_case["refs"], strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}"
        assert completion.logprobs is not None
        ours = [entry[tok].logprob for entry, tok in zip(completion.logprobs, ref_tokens, strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
    if scenario == "preempt":
        assert llm.engine.stats().num_preemptions > 0


def test_bf16_logprobs_near_the_dequantized_reference(gguf_case: dict[str, Any]) -> None:
    """bf16 activations (q4_gemm's VNNI path): logprobs within 0.1 of the float32 reference."""
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


def test_the_plan_holds_the_only_copy_of_each_q4_1_weight(gguf_case: dict[str, Any]) -> None:
    """The runner's plan packs the file's Q4_1 blocks and releases the module's
    own: a meta tensor of the same shape remains; the output is unchanged."""
    llm = LLM(gguf_case["path"], dtype="float32", quantization="gguf", skip_tokenizer_init=True,
              num_kv_blocks=512)
    plan = llm.engine.runner.forward
    if not isinstance(plan, CpuPlan):
        pytest.skip("the C++ kernels are not built here")
    o_proj = llm.engine.runner.model.model.layers[1].self_attn.o_proj  # (Q4_1 in both layouts)
    assert o_proj.q4_1.device.type == "meta" and o_proj.q4_1.shape[-1] == 20
    assert plan.layers[1].o.data.device.type == "cpu"


def test_reference_model_dequantizes_q4_1_on_the_fly(gguf_case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C++ kernels off the reference model serves the Q4_1 blocks (the
    mixed layout: a Q4 embedding and head too)."""
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    llm = LLM(gguf_case["path"], dtype="float32", quantization="gguf", skip_tokenizer_init=True,
              num_kv_blocks=512)
    assert not isinstance(llm.engine.runner.forward, CpuPlan)
    outs = _generate(llm, 4)
    for out, (ref_tokens, _) in zip(outs, gguf_case["refs"][:4], strict=True):
        assert out.outputs[0].token_ids == ref_tokens


def test_gguf_quantization_needs_a_gguf_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON))
    path = save_hf_model(hf_model, tmp_path)
    with pytest.raises(ValueError, match=r"quantization='gguf' runs a GGUF file's own quantized blocks, "
                                         r"but .* is a Hugging Face checkpoint"):
        LLM(path, quantization="gguf", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization='gguf' cannot be used with tensor_parallel_size=2"):
        EngineArgs(quantization="gguf", tensor_parallel_size=2).create_parallel_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "gguf"])).quantization == "gguf"


def test_a_quantized_gguf_runs_its_own_blocks_unless_told(tmp_path: Path) -> None:
    """Unset quantization: a GGUF file holding quantized tensors runs its own
    blocks (llama.cpp's way) on one CPU process; a float GGUF, a HF directory,
    `none` and tensor parallelism run the weights in dtype."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON))
    quantized, floats = tmp_path / "q.gguf", tmp_path / "f.gguf"
    _write_gguf(hf_model, quantized, {})
    _write_gguf(hf_model, floats, dict.fromkeys(("token_embd", "output", "attn_q", "attn_k", "attn_v",
                                                 "attn_output", "ffn_gate", "ffn_up", "ffn_down"), F16))
    hf_dir = save_hf_model(hf_model, tmp_path / "hf")
    assert EngineArgs(model=str(quantized)).resolve_quantization() == "gguf"
    assert EngineArgs(model=str(quantized), quantization="none").resolve_quantization() is None
    assert EngineArgs(model=str(quantized), quantization="q8_0").resolve_quantization() == "q8_0"
    assert EngineArgs(model=str(quantized), tensor_parallel_size=2).resolve_quantization() is None
    assert EngineArgs(model=str(quantized), quantization="none",
                      tensor_parallel_size=2).create_parallel_config().tensor_parallel_size == 2
    assert EngineArgs(model=str(floats)).resolve_quantization() is None
    assert EngineArgs(model=hf_dir).resolve_quantization() is None
    with pytest.raises(ValueError, match=r"quantization='q4' is not supported; use one of "
                                         r"\('none', 'q8_0', 'gguf'\), or leave it unset"):
        EngineArgs(model=str(quantized), quantization="q4").resolve_quantization()
    llm = LLM(str(quantized), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    plan = llm.engine.runner.forward
    if isinstance(plan, CpuPlan):
        assert plan.ops.weight_formats()[plan.layers[0].o.format] == "q4_1"
    o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
    assert "weight" not in o_proj._parameters and q4_1_of(o_proj) is not None


def test_bench_interactive_has_gguf_columns(tmp_path: Path) -> None:
    """tokenmill-gguf: `tokenmill serve --quantization gguf`; llama-q4_1: llama-server
    on the default model's own file (nothing made with llama-quantize)."""
    from tokenmill.bench import interactive

    parser = argparse.ArgumentParser()
    interactive.add_args(parser)
    server = tmp_path / "bin" / "llama-server"  # (only named: no server starts here)
    server.parent.mkdir()
    server.write_text("")
    args = parser.parse_args(["--servers", "tokenmill-gguf,llama-q4_1", "--llama-server", str(server)])
    tm, llama = interactive.server_specs(args, ["tokenmill-gguf", "llama-q4_1"])
    assert tm.label == "tokenmill-gguf" and tm.cmd[-2:] == ["--quantization", "gguf"]
    assert llama.label == "llama-q4_1"
    assert any(str(part).endswith("Q4_1.gguf") for part in llama.cmd)
