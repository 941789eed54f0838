"""Random-weight Llama models of published shapes, written as Hugging Face
directories (config.json, bf16 safetensors shards, a tokenizer) for `bench sizes`.

The weights are written one tensor at a time: each shard's safetensors header is
computed from the shapes alone, then every tensor is drawn, written and dropped
before the next, so an 8B model (14.8 GB) never sits in memory. Values: normal,
std 0.02 (activations stay finite in bf16), norms 1; each tensor from its own
generator seeded by (seed, its index), so a file does not depend on the order of
writing. The tokenizer is the default model's (SmolLM2's 49,152 tokens, saved
from its GGUF by vllm_peer.save_gguf_tokenizer), which llama.cpp's converter
recognises.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# torch is imported where a tensor is made, so the CLI's start-up (which sets
# OpenMP's wait policy before torch loads) never loads it through this module.
if TYPE_CHECKING:
    import torch

BF16_BYTES = 2
WEIGHT_STD = 0.02
DEFAULT_MAX_SHARD_BYTES = 2 << 30
DONE_NAME = ".random-model"  # written last: a directory without it is unfinished

TensorSpec = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class Shape:
    """A Llama layout, or with experts a Qwen3-MoE one (q/k norms, every MLP a
    router and `num_experts` SwiGLU experts of `moe_intermediate_size`, the top
    `num_experts_per_tok` renormalised); `vocab_size` None takes the tokenizer's."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    vocab_size: int | None = None
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    rope_scaling: dict[str, Any] | None = None
    num_experts: int = 0  # 0: a dense Llama
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def tensors(self, vocab_size: int) -> list[TensorSpec]:
        """(checkpoint name, shape) of every tensor, in the order they are written."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        specs: list[TensorSpec] = [("model.embed_tokens.weight", (vocab_size, h))]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            specs += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
            if self.num_experts:
                specs += [(p + "self_attn.q_norm.weight", (self.head_dim,)),
                          (p + "self_attn.k_norm.weight", (self.head_dim,)),
                          (p + "mlp.gate.weight", (self.num_experts, h))]
                width = self.moe_intermediate_size
                for e in range(self.num_experts):
                    specs += [(p + f"mlp.experts.{e}.gate_proj.weight", (width, h)),
                              (p + f"mlp.experts.{e}.up_proj.weight", (width, h)),
                              (p + f"mlp.experts.{e}.down_proj.weight", (h, width))]
                continue
            specs += [
                (p + "mlp.gate_proj.weight", (self.intermediate_size, h)),
                (p + "mlp.up_proj.weight", (self.intermediate_size, h)),
                (p + "mlp.down_proj.weight", (h, self.intermediate_size)),
            ]
        specs.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            specs.append(("lm_head.weight", (vocab_size, h)))
        return specs

    def num_params(self, vocab_size: int) -> int:
        return sum(_numel(s) for _, s in self.tensors(vocab_size))

    def active_params(self, vocab_size: int) -> int:
        """The parameters one token's forward reads (its k experts of each layer's)."""
        total = self.num_params(vocab_size)
        if not self.num_experts:
            return total
        expert = 3 * self.hidden_size * self.moe_intermediate_size
        return total - self.num_layers * (self.num_experts - self.num_experts_per_tok) * expert

    def config(self, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
        """config.json, as transformers writes a LlamaForCausalLM's (Qwen3MoeForCausalLM's)."""
        moe: dict[str, Any] = {}
        if self.num_experts:
            moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                   "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                   "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": True,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False}
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": "bfloat16",
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "initializer_range": WEIGHT_STD, "use_cache": True, **moe,
        }


# Llama 3's RoPE scaling, as Llama-3.2-1B and Llama-3.1-8B publish it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SMOLLM2_VOCAB = 49152  # the default model's tokenizer, which every shape here uses
SHAPES = {
    # Llama-3.2-1B: tied embeddings; 1.07 B parameters with the 49,152-token vocabulary.
    "1b": Shape("llama-1b-shape", 16, 2048, 8192, 32, 8, 64, True, SMOLLM2_VOCAB, rope_scaling=LLAMA3_ROPE),
    # Llama-3.1-8B: its own LM head; 7.38 B parameters with the 49,152-token vocabulary.
    "8b": Shape("llama-8b-shape", 32, 4096, 14336, 32, 8, 128, False, SMOLLM2_VOCAB,
                rope_scaling=LLAMA3_ROPE),
    # Qwen3-30B-A3B's proportions at half its width: 48 layers, hidden 1024 (2048), 16 query
    # heads of 128 and 2 KV heads (32 and 4), 64 experts of 384 (128 of 768), top 8;
    # 3.95 B parameters, 0.78 B active a token, with the 49,152-token vocabulary.
    "moe": Shape("qwen3-moe-shape", 48, 1024, 3072, 16, 2, 128, False, SMOLLM2_VOCAB,
                 max_position_embeddings=40960, rope_theta=1e6, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=384),
}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def random_tensor(seed: int, index: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor `index` of a model: norms are ones, every other weight N(0, WEIGHT_STD) in bf16."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, WEIGHT_STD, generator=g)


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _numel(spec[1]) * BF16_BYTES
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def safetensors_header(specs: Sequence[TensorSpec]) -> bytes:
    """The length-prefixed JSON header of a bf16 safetensors file holding `specs` in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        end = offset + _numel(shape) * BF16_BYTES
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


MakeTensor = Callable[[int, str, tuple[int, ...]], "torch.Tensor"]


def write_shards(out_dir: Path, specs: Sequence[TensorSpec], make_tensor: MakeTensor,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, str]:
    """Write `specs` as safetensors shards (model-0000i-of-0000n.safetensors and the index),
    each tensor made by `make_tensor(index, name, shape)` just before it is written and
    released after; returns the weight map."""
    import torch

    shards = plan_shards(specs, max_shard_bytes)
    weight_map: dict[str, str] = {}
    index = 0
    for i, shard in enumerate(shards):
        fname = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                 else "model.safetensors")
        with open(out_dir / fname, "wb") as f:
            f.write(safetensors_header(shard))
            for name, shape in shard:
                t = make_tensor(index, name, shape)
                if t.dtype != torch.bfloat16 or tuple(t.shape) != shape:
                    raise ValueError(f"{name}: made {t.dtype} {tuple(t.shape)}, wanted bf16 {shape}")
                f.write(t.contiguous().view(torch.uint8).numpy().data)
                del t
                weight_map[name] = fname
                index += 1
    total = sum(_numel(s) * BF16_BYTES for _, s in specs)
    if len(shards) > 1:
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return weight_map


def write_random_model(shape: Shape, out_dir: Path, tokenizer_gguf: Path, seed: int = 0,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """`shape` with random weights as a Hugging Face directory at out_dir (the tokenizer
    from `tokenizer_gguf`); a finished directory is left as it is."""
    out_dir = Path(out_dir)
    done = out_dir / DONE_NAME
    if done.exists():
        return out_dir
    from transformers import AutoTokenizer

    from tokenmill.bench.vllm_peer import save_gguf_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    save_gguf_tokenizer(tokenizer_gguf, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    vocab_size = shape.vocab_size or len(tok)
    if len(tok) > vocab_size:
        raise ValueError(f"{shape.name}: vocab_size {vocab_size} < the tokenizer's {len(tok)} tokens")
    config = shape.config(vocab_size, tok.bos_token_id, tok.eos_token_id)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    specs = shape.tensors(vocab_size)
    print(f"== writing {shape.name} ({shape.num_params(vocab_size) / 1e9:.2f} B parameters, "
          f"seed {seed}) to {out_dir}", file=sys.stderr, flush=True)
    write_shards(out_dir, specs, lambda i, name, s: random_tensor(seed, i, name, s), max_shard_bytes)
    done.write_text(json.dumps({"shape": shape.name, "seed": seed, "std": WEIGHT_STD,
                                "tokenizer": str(tokenizer_gguf)}) + "\n")
    return out_dir
