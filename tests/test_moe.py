"""Mixtures of experts (Qwen3-MoE, Mixtral) beyond the family suites.

test_correctness and test_model_numerics run the tiny Qwen3-MoE and Mixtral of
tests/hf_models.ARCHS against transformers; test_gguf_families their GGUF files
(float32 and Q8_0). Here: a GGUF whose stacked experts are k-quant blocks keeps
each expert's slice of the file's blocks (quantization="gguf") and gives the
dequantized model's tokens; the router stays float under every quantization;
bf16 rows give the same bits alone and in a batch; what is refused says so.
"""

from __future__ import annotations

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
    VOCAB_SIZE,
    build_hf_model,
    finish_gguf,
    gguf_tensors,
    gguf_writer,
    hf_greedy,
    save_hf_model,
)
from tests.test_quantization_kquants import _random_blocks
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.model.gguf_tensors import WeightLoadError
from tokenmill.model.llama import SparseMoeBlock
from tokenmill.model.loader import load_model
from tokenmill.model.parallel import ShardLayout
from tokenmill.model.quantization import KQUANT_FORMATS, dequantize_kquant, kquant_of, q8_0_of
from tokenmill.model.source import resolve_model_source

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="quantization runs on the CPU")
GT = gguf.GGMLQuantizationType
PROMPTS = [[5, 9, 33, 100, 7, 8, 9, 10], [3, 4, 200, 17], list(range(3, 40)), [250, 3, 3, 3, 77]]


def _kquant_moe(path: Path) -> dict[str, np.ndarray]:
    """A tiny Qwen3-MoE (hidden 256: k-quants take rows of 256) as a GGUF file whose
    stacked experts are Q4_K (gate, up) and Q6_K (down) blocks, the rest float32.
    Each stacked tensor's blocks as written, [E * out, bytes a row]."""
    config = transformers.Qwen3MoeConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 256},
                                         head_dim=64, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=256, norm_topk_prob=True)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    writer = gguf_writer(hf_model, path, "qwen3moe")
    writer.add_tokenizer_pre("qwen2")
    written = {}
    for i, (name, part, _, weight, _) in enumerate(gguf_tensors(hf_model)):
        if not part.endswith("_exps"):
            writer.add_tensor(name, weight)
            continue
        kind = GT.Q6_K if part == "ffn_down_exps" else GT.Q4_K
        experts, rows, k = weight.shape
        data = _random_blocks(KQUANT_FORMATS[kind.name], experts * rows, k, seed=i).numpy()
        writer.add_tensor(name, data.reshape(experts, rows, -1), raw_dtype=kind)
        written[name] = data
    finish_gguf(writer)
    return written


def test_kquant_experts_keep_their_blocks_and_give_the_dequantized_tokens(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    written = _kquant_moe(path)
    source = resolve_model_source(str(path))
    model, spec = load_model(ModelConfig(dtype="float32", quantization="gguf"), source)
    assert spec.architecture == "Qwen3MoeForCausalLM" and spec.num_experts == 4
    for layer_index, layer in enumerate(model.model.layers):
        moe = layer.mlp
        assert isinstance(moe, SparseMoeBlock) and "weight" in moe.gate._parameters  # the router: float
        for e, expert in enumerate(moe.experts):
            fmt, blocks = kquant_of(expert.down_proj)  # type: ignore[misc]
            down = written[f"blk.{layer_index}.ffn_down_exps.weight"]
            rows = spec.hidden_size
            assert fmt.name == "Q6_K"
            assert np.array_equal(blocks.reshape(rows, -1).numpy(), down[e * rows:(e + 1) * rows].reshape(rows, -1))
            fmt, blocks = kquant_of(expert.gate_up_proj)  # type: ignore[misc]
            gate = written[f"blk.{layer_index}.ffn_gate_exps.weight"]
            width = spec.moe_intermediate_size
            assert fmt.name == "Q4_K"  # [gate; up]: the gate's rows of expert e first
            assert np.array_equal(blocks[:width].reshape(width, -1).numpy(),
                                  gate[e * width:(e + 1) * width].reshape(width, -1))
            values = dequantize_kquant(fmt, blocks)
            assert values.shape == (2 * width, spec.hidden_size)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = []
    for quantization in ("gguf", None):  # (None: every weight dequantized to float32 at load)
        llm = LLM(str(path), dtype="float32", quantization=quantization, skip_tokenizer_init=True,
                  num_kv_blocks=64)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False))
        del llm
    for kept, dequantized in zip(*runs, strict=True):
        assert kept.outputs[0].token_ids == dequantized.outputs[0].token_ids
        ours = [entry[t].logprob for entry, t in zip(kept.outputs[0].logprobs or [], kept.outputs[0].token_ids,
                                                     strict=True)]
        ref = [entry[t].logprob for entry, t in zip(dequantized.outputs[0].logprobs or [],
                                                    dequantized.outputs[0].token_ids, strict=True)]
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_q8_0_keeps_the_router_float(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("mixtral"), tmp_path)
    model, _ = load_model(ModelConfig(dtype="float32", quantization="q8_0"), resolve_model_source(path))
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoeBlock)
    assert q8_0_of(moe.gate) is None and "weight" in moe.gate._parameters
    assert all(q8_0_of(e.gate_up_proj) is not None and q8_0_of(e.down_proj) is not None for e in moe.experts)


def test_bf16_rows_give_the_same_bits_alone_and_together(tmp_path: Path) -> None:
    """Batch invariance: each prompt's greedy tokens and logprobs, bf16, alone and
    with the others in one batch (the experts see other row counts)."""
    path = save_hf_model(build_hf_model("qwen3-moe"), tmp_path)
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    together = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == out.outputs[0].token_ids
        assert [e[t].logprob for e, t in zip(alone.logprobs or [], alone.token_ids, strict=True)] == [
            e[t].logprob for e, t in zip(out.outputs[0].logprobs or [], alone.token_ids, strict=True)]


def _config_dir(tmp_path: Path, arch: str, **overrides: Any) -> str:
    import json

    path = save_hf_model(build_hf_model(arch), tmp_path)
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config.update(overrides)
    config_path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("arch", "overrides", "message"), [
    ("mixtral", {"num_local_experts": 4096}, "num_local_experts=4096 is invalid; the checkpoint's tensors are of 4"),
    ("mixtral", {"num_local_experts": 1 << 20}, "at most 4096"),
    ("qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 is invalid; a token picks at most the 8"),
    ("qwen3-moe", {"mlp_only_layers": [5]}, "mlp_only_layers=[5] is invalid"),
])
def test_bad_moe_configs_are_refused_naming_the_field(tmp_path: Path, arch: str, overrides: dict[str, Any],
                                                      message: str) -> None:
    path = _config_dir(tmp_path, arch, **overrides)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model(ModelConfig(dtype="float32"), resolve_model_source(path))


def test_a_gguf_expert_count_the_tensors_do_not_bear_out_is_refused(tmp_path: Path) -> None:
    hf_model = build_hf_model("mixtral")
    path = tmp_path / "m.gguf"
    writer = gguf_writer(hf_model, path, "llama")
    writer.add_tokenizer_pre("qwen2")
    writer.add_expert_count(6)  # (over gguf_writer's 4, the tensors' count)
    for name, _, _, weight, _ in gguf_tensors(hf_model):
        writer.add_tensor(name, weight)
    finish_gguf(writer)
    with pytest.raises(WeightLoadError, match=r"llama.expert_count=6"):
        load_model(ModelConfig(dtype="float32"), resolve_model_source(str(path)))


def test_tensor_parallel_and_lora_refuse_experts(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("mixtral"), tmp_path)
    _, spec = load_model(ModelConfig(dtype="float32"), resolve_model_source(path))
    with pytest.raises(ValueError, match="does not split MixtralForCausalLM's experts yet; drop --tensor-parallel"):
        ShardLayout.of(spec, 0, 2)
    with pytest.raises(ValueError, match="LoRA adapters are not supported on MixtralForCausalLM"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16, enable_lora=True)


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> MXFP4 blocks [..., K / 32, 16] and E8M0 scales [..., K / 32], as OpenAI
    ships gpt-oss's experts: each 32 values a shared power of two (the smallest that
    fits their largest magnitude in E2M1's 6), each value its nearest E2M1 code."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0**-100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones(()), exponent.int()).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """OpenAI's checkpoint layout: each layer's experts as MXFP4 `*_blocks` / `*_scales`
    ([E, out, in / 32, 16] and [E, out, in / 32]); tokenmill dequantizes them at load.
    The oracle: transformers' own MXFP4 conversion put into the float model."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build_hf_model("gpt-oss")
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            blocks, scales = _mxfp4(param.transpose(1, 2))  # [E, in, out] -> [E, out, in] rows
            param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    model.config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[(i * 7 + j * 3) % (VOCAB_SIZE - 3) + 3 for j in range(5 + 9 * i)] for i in range(4)]
    llm = LLM(str(tmp_path), dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True, num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = hf_greedy(model, prompt, 10)
        assert out.outputs[0].token_ids == tokens
        ours = [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-4)
    # Half a pair is refused, naming the missing half.
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="down_proj_scales is missing"):
        load_model(ModelConfig(model=str(tmp_path), dtype="float32"), resolve_model_source(str(tmp_path)))
