"""Maintainer check: files written by llama.cpp's own converter load in tokenmill
and give the Hugging Face directory's tokens, for the families whose converter
does more than rename (Phi-3's fused tensors and LongRoPE factors, the experts of
Qwen3-MoE and Mixtral stacked into ffn_*_exps, Gemma 3's 1 + w norms).

For each tiny random model, the sdist's `convert_hf_to_gguf.py` writes a float32
GGUF; tokenmill's greedy tokens on it, on the C++ plan and on the reference, must
equal transformers' on the directory, logprobs within 1e-4. The cases: Phi-3 (a
sliding window of 16), Phi-4-mini (3/4 of each head rotated, LongRoPE within its
original context of 96, a tied head), Qwen3-MoE (8 experts, top 2, q/k norms;
llama.cpp's graph renormalises the top k, so the model does too), Mixtral
(4 experts, top 2; a `llama` file with Q/K rows permuted), Gemma 3 (windows,
a second RoPE base, q/k norms, its norms written as 1 + w), Gemma 2 (windows
on every other layer, the attention and final soft-caps) and gpt-oss (sinks,
windows, YaRN, biased experts stacked into ffn_*_exps); plain Llama as the base case.

    flock /tmp/tokenmill-heavy.lock .venv/bin/python benchmarks/converter_check.py [--llama-cpp DEST] [CASE ...]

The converter needs a known tokenizer: the default model's (SmolLM2's byte-level BPE,
llama.cpp's "smollm"), so the tiny models have its vocabulary; Gemma 2's reads only a
SentencePiece model, which the case trains (384 pieces). Exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from tokenmill import LLM, SamplingParams
from tokenmill.bench.sizes_files import find_llama_cpp
from tokenmill.bench.vllm_peer import save_gguf_tokenizer
from tokenmill.model.source import resolve_model_source

# case -> (transformers config class, its fields beyond the common ones)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "phi3": ("Phi3Config", {"sliding_window": 16}),
    "phi4-mini": ("Phi3Config", {
        "tie_word_embeddings": True, "original_max_position_embeddings": 96,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]},
    }),
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                  "sliding_window": None}),
    # Gemma 3 as its converter writes it: no window pattern (llama.cpp's every 6th layer global, so 6
    # layers here), the query scale the head size's; norms stored as 1 + w.
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 6, "head_dim": 32, "query_pre_attn_scalar": 32,
                                    "sliding_window": 16}),
    # Gemma 2 (every other layer a window, both soft-caps): its converter reads only a
    # SentencePiece tokenizer.model, so this case trains one (SPM_VOCAB pieces).
    "gemma2": ("Gemma2Config", {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16,
                                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # gpt-oss: sinks, a window on every other layer, YaRN, biased experts (bf16 here: the
    # converter writes them as they are; MXFP4 checkpoints it passes through as MXFP4).
    "gpt-oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "intermediate_size": 32, "sliding_window": 8,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 128,
                                                     "rope_theta": 150000.0}}),
}
SPM_CASES = {"gemma2"}
SPM_VOCAB = 384


def train_spm(directory: Path, converter_env: dict[str, str]) -> None:
    """A SentencePiece tokenizer.model of SPM_VOCAB pieces (Gemma's special ids: pad 0,
    eos 1, bos 2, unk 3; byte fallback), trained on generated text with the
    converter's own sentencepiece (its deps' directory)."""
    rng = np.random.default_rng(3)
    words = ["the", "model", "token", "cache", "block", "window", "layer", "expert", "über", "数据", "42", "def"]
    lines = [" ".join(rng.choice(words, size=12)) + f" {rng.integers(0, 10**6)}" for _ in range(4000)]
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    code = ("import sentencepiece as spm; spm.SentencePieceTrainer.train("
            f"input={str(corpus)!r}, model_prefix={str(directory / 'tokenizer')!r}, vocab_size={SPM_VOCAB}, "
            "model_type='bpe', byte_fallback=True, character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, "
            "unk_id=3, minloglevel=2)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **converter_env})
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()


def write_directory(case: str, directory: Path, tokenizer_gguf: str, converter_env: dict[str, str]) -> Any:
    if case in SPM_CASES:
        train_spm(directory, converter_env)
        vocab, bos, eos = SPM_VOCAB, 2, 1
    else:
        save_gguf_tokenizer(tokenizer_gguf, directory)
        tok = transformers.AutoTokenizer.from_pretrained(directory)
        config_path = directory / "tokenizer_config.json"  # (Phi3MiniModel.set_vocab reads its class)
        tok_config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**tok_config, "tokenizer_class": "GPT2Tokenizer"}, indent=2))
        vocab, bos, eos = len(tok), tok.bos_token_id, tok.eos_token_id
    config_class, fields = CASES[case]
    config = getattr(transformers, config_class)(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "initializer_range": 0.1, "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": 0, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms spread, so a swapped or lost one shows; sinks and biases too
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            if name.endswith(("sinks", "bias")):
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens, strict=True)]


def tokenmill_greedy(path: str, prompts: list[list[int]], lengths: list[int], cpp: bool) -> list[Any]:
    if cpp:
        os.environ.pop("TOKENMILL_NO_CPP_KERNELS", None)
    else:
        os.environ["TOKENMILL_NO_CPP_KERNELS"] = "1"
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=8, num_kv_blocks=512)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print(f"   forward: {type(llm.engine.runner.forward).__name__}", flush=True)
    return [o.outputs[0] for o in outs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", help="build_llama_cpp.sh's DEST (default /work/llama.cpp-build)")
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    args = parser.parse_args()
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    llama_cpp = find_llama_cpp(args.llama_cpp)
    llama_cpp.require(llama_cpp.converter)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, size=int(rng.integers(1, 60))).tolist() for _ in range(12)]
    lengths = rng.integers(4, 20, size=len(prompts)).tolist()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases or CASES:
            directory = Path(tmp) / case
            directory.mkdir()
            model = write_directory(case, directory, resolve_model_source(None).path, llama_cpp.converter_env())
            out = Path(tmp) / f"{case}.gguf"
            subprocess.run([sys.executable, str(llama_cpp.converter), str(directory), "--outfile", str(out),
                            "--outtype", "f32"], check=True, env={**os.environ, **llama_cpp.converter_env()},
                           stdout=subprocess.DEVNULL)
            refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths, strict=True)]
            for cpp in (True, False):
                print(f"== {case} ({'plan' if cpp else 'reference'}): llama.cpp's file", flush=True)
                for i, (ours, (tokens, logprobs)) in enumerate(
                        zip(tokenmill_greedy(str(out), prompts, lengths, cpp), refs, strict=True)):
                    got = [e[t].logprob for e, t in zip(ours.logprobs, tokens, strict=True)] if (
                        ours.token_ids == tokens) else []
                    if ours.token_ids != tokens or not np.allclose(got, logprobs, atol=1e-4):
                        failures += 1
                        print(f"   prompt {i}: tokens {ours.token_ids}, logprobs {got}; transformers' "
                              f"{tokens}, {logprobs}", flush=True)
            print(f"== {case}: {'ok' if not failures else f'{failures} mismatches so far'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
