"""GGUF architectures: one row per `general.architecture` tokenmill loads.

A row says how a family's llama.cpp file maps onto tokenmill: the ModelSpec
architecture it builds, its llama.cpp tensor names as Hugging Face names, and
what its converter did to the weights. Every family's metadata keys are
llama.cpp's `{arch}.<key>` (`{arch}.block_count`, `{arch}.embedding_length`,
`{arch}.attention.head_count_kv`, `{arch}.rope.freq_base`, ...), read by
spec.spec_from_gguf with the row's key as the prefix. Adding a family whose
model tokenmill already runs is one more row (docs/ARCHITECTURE.md §5).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# llama.cpp's names outside the layers -> Hugging Face names (every family's).
_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp's names in layer N (blk.N.<name>) -> the HF module under model.layers.N.
_LLAMA_LAYER: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_LAYER: Mapping[str, str] = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# A mixture-of-experts layer's router and its experts stacked [E, out, in], split
# per expert at load (model/moe_checkpoint.py).
_MOE_LAYER: Mapping[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the MLP's input norm (HF's
# pre_feedforward_layernorm), and HF's post_attention_layernorm the attention output's.
_GEMMA_LAYER: Mapping[str, str] = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: llama.cpp keeps Hugging Face's fused tensors (attn_qkv: q, k, v rows; ffn_up:
# gate then up rows), split at load as a config.json's are (model/fused_checkpoint.py);
# its loader also takes separate attn_q / attn_k / attn_v.
_PHI3_LAYER: Mapping[str, str] = {
    **_LLAMA_LAYER,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFFamily:
    architecture: str  # the ModelSpec architecture (Hugging Face class name) it builds
    layer_names: Mapping[str, str]  # blk.N.<llama.cpp name> -> model.layers.N.<HF module>
    # llama.cpp's converter permutes Q/K rows for its interleaved RoPE (llama only):
    # the loader undoes it.
    permuted_qk: bool
    attention_bias: bool = False  # q/k/v carry biases (blk.N.attn_q.bias, ...)
    qk_norm: bool = False  # per-head RMSNorms on q and k before RoPE
    # What llama.cpp's converter added to every norm weight (Gemma: the 1 of its
    # (1 + w) RMSNorm); the loader takes it off again, as transformers' GGUF loader.
    norm_shift: float = 0.0

    def hf_name(self, name: str) -> str:
        """A llama.cpp tensor name as its Hugging Face name (unknown names unchanged,
        so that the loader reports them as unexpected)."""
        stem, dot, suffix = name.rpartition(".")
        if stem in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[stem]}{dot}{suffix}"
        match = _LAYER_RE.match(name)
        if match and match.group(2) in self.layer_names:
            layer, part, kind = match.groups()
            return f"model.layers.{layer}.{self.layer_names[part]}.{kind}"
        return name


GGUF_FAMILIES: Mapping[str, GGUFFamily] = {
    # Llama, SmolLM2, Mistral, Mixtral (llama.cpp converts Mistral and Mixtral as llama).
    "llama": GGUFFamily("LlamaForCausalLM", {**_LLAMA_LAYER, **_MOE_LAYER}, permuted_qk=True),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", _LLAMA_LAYER, permuted_qk=False, attention_bias=True),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORM_LAYER}, permuted_qk=False,
                        qk_norm=True),
    "qwen3moe": GGUFFamily("Qwen3MoeForCausalLM", {**_LLAMA_LAYER, **_QK_NORM_LAYER, **_MOE_LAYER},
                           permuted_qk=False, qk_norm=True),
    "gemma2": GGUFFamily("Gemma2ForCausalLM", _GEMMA_LAYER, permuted_qk=False, norm_shift=1.0),
    "gemma3": GGUFFamily("Gemma3ForCausalLM", {**_GEMMA_LAYER, **_QK_NORM_LAYER}, permuted_qk=False,
                         qk_norm=True, norm_shift=1.0),
    # Phi-3, Phi-4 (LongRoPE and partial rotary: spec_phi3.phi3_gguf_fields).
    "phi3": GGUFFamily("Phi3ForCausalLM", _PHI3_LAYER, permuted_qk=False),
}


def gguf_family(arch: object, path: str) -> GGUFFamily:
    """The row for a file's `general.architecture`; a ValueError naming it otherwise."""
    family = GGUF_FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (general.architecture); "
            f"supported: {', '.join(GGUF_FAMILIES)} (Llama, SmolLM2, Mistral, Mixtral, Qwen2, Qwen3, "
            "Qwen3-MoE, Gemma 2, Gemma 3, Phi-3 / Phi-4); "
            "use a Hugging Face directory of a supported model instead"
        )
    return family
