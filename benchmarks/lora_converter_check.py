"""Maintainer check: a LoRA adapter converted by llama.cpp's own
convert_lora_to_gguf.py serves in tokenmill with peft's tokens.

A tiny random Llama (a Hugging Face directory) and a PEFT adapter on it (rank 8,
every target, random A and B), converted by the sdist's `convert_lora_to_gguf.py
--base DIR --outtype f32`; tokenmill's greedy tokens with the GGUF file, on the
C++ plan and on the reference, must equal transformers + peft's, logprobs within
1e-4, 12 prompts beside base requests. tests/test_lora_gguf.py writes its files
the same way with the gguf package; this checks that way is the converter's.

    flock /tmp/tokenmill-heavy.lock .venv/bin/python benchmarks/lora_converter_check.py [--llama-cpp DEST]

Exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import peft
import torch
import transformers

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.bench.sizes_files import find_llama_cpp


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens, strict=True)]


def write_models(directory: Path) -> tuple[Any, Any]:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(directory / "base", safe_serialization=True)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory / "base"), lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.eval().save_pretrained(directory / "adapter")
    return base, model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", help="build_llama_cpp.sh's DEST (default /work/llama.cpp-build)")
    args = parser.parse_args()
    llama_cpp = find_llama_cpp(args.llama_cpp)
    llama_cpp.require(llama_cpp.converter)
    converter = llama_cpp.converter.with_name("convert_lora_to_gguf.py")
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 256, size=int(rng.integers(1, 60))).tolist() for _ in range(12)]
    lengths = rng.integers(4, 20, size=len(prompts)).tolist()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        base, model = write_models(Path(tmp))
        out = Path(tmp) / "adapter.gguf"
        subprocess.run([sys.executable, str(converter), str(Path(tmp) / "adapter"), "--base", str(Path(tmp) / "base"),
                        "--outfile", str(out), "--outtype", "f32"], check=True,
                       env={**os.environ, **llama_cpp.converter_env()}, stdout=subprocess.DEVNULL)
        on = [i % 2 == 0 for i in range(len(prompts))]  # every other prompt with the adapter
        refs = [hf_greedy(model if a else base, p, n) for a, p, n in zip(on, prompts, lengths, strict=True)]
        changed = sum(a and r[0] != hf_greedy(base, p, n)[0] for a, r, p, n in zip(on, refs, prompts, lengths,
                                                                                    strict=True))
        for cpp in (True, False):
            if cpp:
                os.environ.pop("TOKENMILL_NO_CPP_KERNELS", None)
            else:
                os.environ["TOKENMILL_NO_CPP_KERNELS"] = "1"
            llm = LLM(str(Path(tmp) / "base"), dtype="float32", skip_tokenizer_init=True, enable_lora=True,
                      max_lora_rank=8, max_num_batched_tokens=8, num_kv_blocks=512)
            lora = LoRARequest("converted", 1, str(out))
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                lora_request=[lora if a else None for a in on])
            print(f"== {'plan' if cpp else 'reference'} ({type(llm.engine.runner.forward).__name__}), "
                  f"llama.cpp's adapter file; the adapter changes {changed} of {sum(on)} answers", flush=True)
            for i, (o, (tokens, logprobs)) in enumerate(zip(outs, refs, strict=True)):
                ours = o.outputs[0]
                got = [e[t].logprob for e, t in zip(ours.logprobs, tokens, strict=True)] if (
                    ours.token_ids == tokens) else []
                if ours.token_ids != tokens or not np.allclose(got, logprobs, atol=1e-4):
                    failures += 1
                    print(f"   prompt {i} (adapter {on[i]}): tokens {ours.token_ids}, logprobs {got}; peft's "
                          f"{tokens}, {logprobs}", flush=True)
    print("ok" if not failures else f"{failures} mismatches", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
