"""GGUF LoRA adapters, as llama.cpp's convert_lora_to_gguf.py writes them.

The files here are written the converter's way with the gguf package:
general.type "adapter", adapter.type "lora", adapter.lora.alpha, every PEFT
lora_A / lora_B under the base weight's llama.cpp name + ".lora_a" / ".lora_b",
in F16 (the converter's default) and, for llama, lora_B's q/k rows permuted as
the converter permutes the base's q/k. tokenmill's greedy tokens and logprobs
with each file equal peft's with the same adapter (its A and B rounded to F16,
what the file holds), batched with base requests, within float32's 1e-4.
(`benchmarks/lora_converter_check.py` runs llama.cpp's own converter.)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.hf_models import build_hf_model, hf_greedy, save_hf_model
from tests.test_correctness import MAX_TOKENS, PROMPTS
from tests.test_lora import make_peft
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.model.lora import LoRAError

# peft module -> llama.cpp's tensor name in a layer.
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
ADAPTERS = (0, 2, 3)  # test_lora's adapters without rsLoRA (GGUF records alpha only)


def converter_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for its interleaved RoPE (the rows of
    each head's two halves interleaved)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf_lora(model: Any, path: Path, arch: str = "llama", extra: dict[str, Any] | None = None,
                    general_type: str = "adapter") -> None:
    config = model.base_model.model.config
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    lora = model.peft_config["default"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora.lora_alpha))
    for name, tensor in {**model.state_dict(), **(extra or {})}.items():
        if "lora_" not in name:
            continue
        parts = name.replace(".default.", ".").split(".")  # (peft's state dict names the adapter)
        layer, target, which = int(parts[parts.index("layers") + 1]), parts[-3], parts[-2]
        weight = tensor.detach().float()
        if which == "lora_B" and target in heads:
            weight = converter_permute(weight, heads[target])
        suffix = "lora_a" if which == "lora_A" else "lora_b"
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES.get(target, target)}.weight.{suffix}",
                          weight.numpy().astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rounded_to_f16(model: Any) -> Any:
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(param.half().float())
    return model


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = Path(tmp_path_factory.mktemp("lora_gguf"))
    base = build_hf_model("llama")
    models = {k: make_peft(base, k) for k in ADAPTERS}
    for k, model in models.items():
        write_gguf_lora(model, root / f"adapter{k}.gguf")
    return {"root": root, "base": base, "path": save_hf_model(base, root / "base"), "models": models}


def test_gguf_adapters_match_peft(case: dict[str, Any]) -> None:
    loras = [None, *(LoRARequest(f"a{k}", k + 1, str(case["root"] / f"adapter{k}.gguf")) for k in ADAPTERS)]
    refs = [rounded_to_f16(case["models"][k]) for k in ADAPTERS]
    llm = LLM(case["path"], dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=2,
              max_cpu_loras=len(ADAPTERS), num_kv_blocks=512, max_num_batched_tokens=16)
    chosen = [i % len(loras) for i in range(len(PROMPTS))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           lora_request=[loras[c] for c in chosen])
    changed = 0
    for i, (out, c) in enumerate(zip(outputs, chosen, strict=True)):
        ref_tokens, ref_logprobs = hf_greedy(case["base"] if c == 0 else refs[c - 1], PROMPTS[i], MAX_TOKENS[i])
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i} (adapter {c})"
        assert completion.logprobs is not None
        ours = [entry[t].logprob for entry, t in zip(completion.logprobs, ref_tokens, strict=True)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, err_msg=f"prompt {i}")
        if c and ref_tokens != hf_greedy(case["base"], PROMPTS[i], MAX_TOKENS[i])[0]:
            changed += 1
    assert changed  # (the adapters change some answer: a lost delta would show)


def test_bad_gguf_adapters_are_refused_saying_why(case: dict[str, Any], tmp_path: Path) -> None:
    llm = LLM(case["path"], dtype="float32", skip_tokenizer_init=True, enable_lora=True,
              max_cpu_loras=4, num_kv_blocks=64)
    model = case["models"][0]
    bad = {
        "model": ({"general_type": "model"}, "not a LoRA adapter"),
        "arch": ({"arch": "qwen2"}, "adapts a Qwen2ForCausalLM model"),
        "embedding": ({"extra": {"base_model.model.model.layers.0.embed.lora_A.weight": torch.ones(2, 64)}},
                      "embed"),
    }
    for name, (kwargs, phrase) in bad.items():
        path = tmp_path / f"{name}.gguf"
        write_gguf_lora(model, path, **kwargs)
        with pytest.raises(LoRAError, match=phrase):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False,
                         lora_request=LoRARequest(name, 10, str(path)))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes((case["root"] / "adapter0.gguf").read_bytes()[:200])
    with pytest.raises(LoRAError, match="could not be read as GGUF"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("truncated", 11, str(truncated)))
    # The engine still serves after each refusal.
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                            use_tqdm=False)[0].outputs[0].token_ids) == 2
